"""HEAD answered as GET without the body (gateway/head.py), against an app of the test's: the real
gateway's routes are tests/gateway/test_http.py's."""

import asyncio

from gateway.head import END_OF_BODY, HeadAsGet


def test_a_heads_answer_ends_at_its_head_and_stops_an_app_that_would_stream_on():
    """An app streaming for ever that never reads `receive` (a StreamingResponse under ASGI 2.4
    listens for no disconnect): the HEAD reaches it as a GET, its head is sent, then the end of the
    body, and the app is stopped there; the scope says HEAD again for the server and the log line."""
    seen = []
    sent = []

    async def endless(scope, receive, send):
        seen.append(scope["method"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        while True:
            await send({"type": "http.response.body", "body": b"more", "more_body": True})
            await asyncio.sleep(0.01)

    async def send(message):
        sent.append((scope["method"], message))

    async def receive():
        await asyncio.sleep(3600)

    scope = {"type": "http", "method": "HEAD", "path": "/"}
    asyncio.run(asyncio.wait_for(HeadAsGet(endless)(scope, receive, send), 10))
    assert seen == ["GET"] and scope["method"] == "HEAD"
    assert [(method, message["type"]) for method, message in sent] == [
        ("HEAD", "http.response.start"),
        ("HEAD", "http.response.body"),
    ]
    assert sent[1][1] == END_OF_BODY
