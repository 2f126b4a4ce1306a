"""Protocol helpers without a server: key names, wire validation, entry parsing, and the
worker's batched commands against fakeredis."""

import json
import subprocess
import sys
import uuid

import fakeredis
import pytest

from producer_client.errors import BodyTooLarge, InvalidArgument, InvalidBody, UnsupportedVersion
from producer_client.keys import GROUP, PROTOCOL_VERSION, Keys, check_name
from producer_client.protocol.backlog import QueueStream, stream_stats
from producer_client.protocol.clock import entry_age_s, entry_time
from producer_client.protocol.events import encode_start, encode_tokens
from producer_client.protocol.replies import Look, Watched
from producer_client.schema import JobRequest
from worker.loop.intake import job_id_of, parse_request
from worker.loop.job_commands import JobCommands
from worker.loop.worker_queue import WorkerQueue

LIMITS = dict(max_body_bytes=1000, max_tokens_limit=64)


def entry(body, v=str(PROTOCOL_VERSION), job_id="job-1"):
    return {"id": job_id, "v": v, "body": body if isinstance(body, str) else json.dumps(body)}


def test_a_jobs_keys_share_one_hash_tag_and_a_queues_keys_another():
    keys = Keys("mili")
    assert keys.job("abc") == "mili:job:{abc}"
    assert keys.events("abc") == "mili:ev:{abc}"
    assert keys.queue("default") == "mili:q:{default}"
    assert keys.dead("default") == "mili:dead:{default}"
    assert keys.workers("default") == "mili:workers:{default}"
    assert keys.queues() == "mili:queues"
    assert keys.worker("w1") == "mili:worker:{w1}"
    assert Keys("other").job("abc") == "other:job:{abc}"


@pytest.mark.parametrize("name", ["", "a b", "a{b}", "-lead", "x" * 129, 7, None])
def test_names_that_would_break_a_key_are_rejected(name):
    with pytest.raises(InvalidArgument) as e:
        check_name("job_id", name)
    assert e.value.field == "job_id"


def test_a_valid_body_parses():
    req = parse_request(entry({"prompt": "hi", "params": {"max_tokens": 3, "temperature": 0}}), **LIMITS)
    assert req.prompt == "hi" and req.params.max_tokens == 3 and req.params.temperature == 0.0


@pytest.mark.parametrize(
    "fields, error, code",
    [
        (entry("not json"), InvalidBody, "invalid_body"),
        (entry("[1, 2]"), InvalidBody, "invalid_body"),
        (entry({"prompt": "hi"}, v="1"), UnsupportedVersion, "unsupported_version"),  # protocol v1: refused
        ({"v": str(PROTOCOL_VERSION), "body": "{}"}, InvalidBody, "invalid_body"),
        ({"id": "j", "v": str(PROTOCOL_VERSION)}, InvalidBody, "invalid_body"),
        (entry({"prompt": 5}), InvalidArgument, "invalid_argument"),
        (entry({"prompt": "hi", "params": {"max_tokens": "5"}}), InvalidArgument, "invalid_argument"),
        (entry({"prompt": "hi", "params": {"max_tokens": True}}), InvalidArgument, "invalid_argument"),
        (entry({"prompt": "hi", "colour": "red"}), InvalidArgument, "invalid_argument"),
        (entry({"prompt": "hi", "params": {"max_tokens": 65}}), InvalidArgument, "invalid_argument"),
        (entry({"prompt": "hi", "params": {"temperature": -1}}), InvalidArgument, "invalid_argument"),
        (entry({"prompt": "hi", "params": {"stop": ["x"] * 17}}), InvalidArgument, "invalid_argument"),
        (entry({"prompt": "hi", "params": {"logprobs": 21}}), InvalidArgument, "invalid_argument"),
        (entry({"prompt": "hi", "input_ids": [1]}), InvalidArgument, "invalid_argument"),
        (entry({"input_ids": [-1]}), InvalidArgument, "invalid_argument"),
        (entry({"messages": []}), InvalidArgument, "invalid_argument"),
        (
            entry({"prompt": "hi", "params": {"max_tokens": 3}, "enable_thinking": True}),
            InvalidArgument,
            "invalid_argument",
        ),
        (
            entry({"input_ids": [1], "params": {"max_tokens": 3}, "parallel_tool_calls": True}),
            InvalidArgument,
            "invalid_argument",
        ),
        (entry({"prompt": "x" * 1000}), BodyTooLarge, "body_too_large"),
        (entry('{"prompt": "\udcff"}'), InvalidBody, "invalid_body"),  # invalid UTF-8, surrogate-escaped
    ],
)
def test_every_bad_entry_raises_an_error_with_its_code(fields, error, code):
    with pytest.raises(error) as e:
        parse_request(fields, **LIMITS)
    assert e.value.code == code


def test_field_errors_name_the_field_as_users_write_it():
    with pytest.raises(InvalidArgument) as e:
        JobRequest.from_json(b'{"prompt": "hi", "params": {"top_p": 0}}', **LIMITS)
    assert e.value.field == "top_p"


def test_entries_without_a_usable_id_are_reported_under_their_entry_id():
    assert job_id_of("17-3", {"id": "ok-1"}) == "ok-1"
    assert job_id_of("17-3", {"id": "bad id"}) == "entry-17-3"
    assert job_id_of("17-3", {}) == "entry-17-3"
    assert entry_time("1700000000123-0") == 1700000000.123


def test_an_entry_age_is_whole_milliseconds_of_the_redis_clock():
    # 1795650645.087 - 1795650644.887 is 0.19999981 in floats: CI's overview read that for 200 ms.
    assert entry_age_s("1795650644887-0", 1795650645087) == 0.2
    assert entry_age_s("1795650644887-3", 1795650644887) == 0.0


def test_acks_go_before_the_read_so_pending_never_grows_past_the_count(redis_client):
    r = redis_client
    queue = f"q-{uuid.uuid4().hex[:8]}"
    q = WorkerQueue(r, Keys(), queue, "w1")
    q.groups.ensure()
    q.groups.ensure()  # a second worker: the group exists already
    stream = Keys().queue(queue)
    for i in range(3):
        r.xadd(stream, {"id": f"j{i}"})
    first = q.reads.read((1, 1, 1), block_ms=None, acks=[])
    assert [(d.fields["id"], d.deliveries) for d in first] == [("j0", 1)]
    second = q.reads.read((1, 1, 1), block_ms=None, acks=[first[0].entry_id])
    assert [d.fields["id"] for d in second] == ["j1"]
    assert r.xpending(stream, GROUP)["pending"] == 1
    assert r.xlen(stream) == 2  # the acked entry is deleted too
    assert q.reads.read((0, 0, 0), block_ms=None, acks=[second[0].entry_id]) == []
    assert r.xpending(stream, GROUP)["pending"] == 0


def test_publish_reports_cancel_flags_readers_and_lost_runs_of_watched_jobs():
    r = fakeredis.FakeRedis(decode_responses=True)
    q = JobCommands(r, Keys(), "w1", result_ttl_s=60)
    r.hset(Keys().job("a"), mapping={"cancel": "1", "run": "ra"})
    r.hset(Keys().job("b"), mapping={"status": "running", "run": "rb"})
    r.hset(Keys().job("c"), mapping={"status": "running", "run": "someone-else"})
    r.hset(Keys().job("d"), mapping={"status": "running", "run": "rd", "streamed": "1"})
    looks = [("a", "ra"), ("b", "rb"), ("c", "rc"), ("d", "rd"), ("e", "re")]
    assert q.publish([], looks) == (
        [],
        [
            Look(Watched.CANCEL),
            Look(Watched.OK),
            Look(Watched.LOST),
            Look(Watched.OK, streamed=True),
            Look(Watched.GONE),
        ],
    )


def test_heartbeat_writes_a_hash_with_ttl_and_indexes_the_worker():
    r = fakeredis.FakeRedis(decode_responses=True)
    q = WorkerQueue(r, Keys(), "q", "w1")
    r.xadd(Keys().queue("q"), {"id": "x"})
    assert q.members.heartbeat({"name": "w1", "free_pages": 7}, ttl_s=5, held=[]) == (1, [])
    assert r.hget(Keys().worker("w1"), "free_pages") == "7"
    assert 0 < r.pttl(Keys().worker("w1")) <= 5000
    assert r.zrange(Keys().workers("q"), 0, -1) == ["w1"]
    assert r.zrange(Keys().queues(), 0, -1) == ["q"]
    q.members.leave()
    assert not r.exists(Keys().worker("w1"))
    assert r.zrange(Keys().workers("q"), 0, -1) == []


def test_a_streams_stats_fall_back_to_depth_minus_pending_when_redis_cannot_tell_the_lag():
    groups = [{"name": GROUP, "pending": 2, "lag": None}]
    stats = stream_stats(QueueStream("k", "default"), depth=5, groups=groups)
    assert (stats.depth, stats.pending, stats.waiting) == (5, 2, 3)
    assert stream_stats(QueueStream("k", "default"), depth=0, groups=[]).waiting == 0


def test_importing_the_producer_client_does_not_import_torch():
    code = "import sys, producer_client, cli.__main__; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_worker_on_the_echo_engine_imports_no_model_stack():
    code = (
        "import sys; from worker.__main__ import load_engine; from worker.settings import WorkerSettings; "
        "load_engine(WorkerSettings(model='echo', redis='redis://127.0.0.1:1/0')); "
        "loaded = [m for m in ('torch', 'numba', 'triton') if m in sys.modules]; assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("ids, text", [([1, 2, 3], 'héllo "q" \\ \n ✓'), ([], ""), ([5], "\x00\x1f"), ([7], "\udcff")])
def test_a_tokens_event_is_the_json_of_its_ids_and_text(ids, text):
    event = encode_tokens(ids, text, None)
    assert event == json.dumps({"ids": ids, "text": text}, ensure_ascii=False, separators=(",", ":"))
    assert json.loads(event) == {"ids": ids, "text": text}


def test_a_tokens_events_ids_are_their_decimals_every_time_kept_or_not():
    """Each id's decimal text is kept once made (events._Decimals): the second event of the same ids
    is the same text, and ids past the kept range (or an int subclass) are written as json.dumps does."""
    from producer_client.protocol.events import DECIMAL_CACHE_IDS

    ids = [0, 9, 10, 151_935, DECIMAL_CACHE_IDS - 1, DECIMAL_CACHE_IDS, 2**31 - 1, 9, 0]
    want = json.dumps({"ids": ids, "text": "x"}, ensure_ascii=False, separators=(",", ":"))
    assert [encode_tokens(ids, "x", None) for _ in range(2)] == [want, want]
    assert encode_tokens([True, 3], "", None) == '{"ids":[1,3],"text":""}'  # an int's value, never "True"


def test_an_exchange_of_no_command_takes_no_connection():
    from producer_client.connection import connect, one_try_options
    from producer_client.protocol.execution import execute
    from worker.embedded_redis import free_port

    nobody = connect(f"redis://127.0.0.1:{free_port()}/0", **one_try_options(0.5))  # nothing listens there
    assert execute(nobody, lambda pipe: None) == []  # a connection would have raised ConnectionError


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
@pytest.mark.parametrize("failures, outcome", [(0, "sent"), (2, "sent"), (3, "ConnectionError")])
def test_an_exchanges_first_try_counts_as_its_retry_policys_first(redis_server, monkeypatch, kind, failures, outcome):
    """The first try of an exchange is made outside the connection's retry policy (no retry layer
    on the way of one that succeeds); one that fails hands its error to the policy, which then
    tries, disconnects and gives up as it would have alone: with 2 retries, 3 tries in all, each
    failure followed by a disconnect, and the third failure raised (as RedisUnavailable's cause)."""
    import asyncio

    import redis
    import redis.asyncio
    from redis.backoff import NoBackoff

    from producer_client.connection import AsyncRetry, Retry
    from producer_client.errors import RedisUnavailable
    from producer_client.protocol import execution

    tries, disconnected = [], []  # disconnected: every connection's disconnect, garbage collected ones' too

    def fail_first_tries(connection):
        tries.append(sum(1 for c in disconnected if c is connection))
        if len(tries) <= failures:
            raise redis.ConnectionError(f"try {len(tries)} failed")

    if kind == "sync":
        client = redis.Redis.from_url(redis_server.url, decode_responses=True, retry=Retry(NoBackoff(), 2))
        round_trip, disconnect = execution._round_trip, client.connection_pool.connection_class.disconnect

        def failing_at_first(redis_client, connection, stack):
            fail_first_tries(connection)
            return round_trip(redis_client, connection, stack)

        def counted(self, *args, **kwargs):
            disconnected.append(self)
            return disconnect(self, *args, **kwargs)

        monkeypatch.setattr(execution, "_round_trip", failing_at_first)
    else:
        client = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True, retry=AsyncRetry(NoBackoff(), 2))
        around_trip, disconnect = execution._around_trip, client.connection_pool.connection_class.disconnect

        async def failing_at_first(redis_client, connection, stack):
            fail_first_tries(connection)
            return await around_trip(redis_client, connection, stack)

        async def counted(self, *args, **kwargs):
            disconnected.append(self)
            return await disconnect(self, *args, **kwargs)

        monkeypatch.setattr(execution, "_around_trip", failing_at_first)
    monkeypatch.setattr(client.connection_pool.connection_class, "disconnect", counted)

    def echo(pipe):
        pipe.echo("sent")

    async def run_async():
        try:
            return await execution.aexecute(client, echo)
        finally:
            await client.aclose()

    try:
        replies = execution.execute(client, echo) if kind == "sync" else asyncio.run(run_async())
        got = replies[0]
    except redis.ConnectionError as e:  # the client's RedisUnavailable, caused by the third failure
        assert isinstance(e, RedisUnavailable) and e.detail == "ConnectionError: try 3 failed"
        got = type(e.__cause__).__name__
        assert str(e.__cause__) == "try 3 failed"
    finally:
        if kind == "sync":
            client.close()
    assert got == outcome
    assert tries == list(range(min(failures + 1, 3)))  # each try after the disconnect of the failure before it


def test_an_exchange_packs_every_argument_as_redis_py_would(redis_client):
    """Commands are packed by hiredis directly; what hiredis refuses goes through redis-py's packer:
    a bytearray is sent as its bytes, None is redis-py's DataError, and nothing of that exchange is
    sent. A command name of two words is two words on the wire."""
    import redis

    from producer_client.protocol.execution import execute

    key = f"packed-{uuid.uuid4().hex}"
    execute(redis_client, lambda pipe: [pipe.set(key, bytearray(b"ab")), pipe.append(key, memoryview(b"c"))])
    with pytest.raises(redis.DataError):
        execute(redis_client, lambda pipe: [pipe.append(key, "d"), pipe.set(key, None)])
    assert execute(redis_client, lambda pipe: [pipe.get(key), pipe.execute_command("OBJECT ENCODING", key)]) == [
        "abc",
        "raw",
    ]


def test_an_exchange_gives_each_reply_as_redis_pys_parse_response_would(redis_client):
    """A reply goes through the client's callback for its command (one set by set_response_callback,
    that of a two-word name: CONFIG GET's dict), a command's error stands in its place, and a
    command recorded with options (EMPTY_RESPONSE) is read by redis-py's parse_response with them:
    the same replies as redis-py's own pipeline gives."""
    import redis
    from redis.client import EMPTY_RESPONSE

    from producer_client.protocol.execution import execute

    text = f"replies-text-{uuid.uuid4().hex}"
    redis_client.set(text, "x")

    def commands(pipe, key):
        pipe.hsetnx(key, "f", "v")
        pipe.hsetnx(key, "f", "w")
        pipe.hget(text, "f")  # WRONGTYPE
        pipe.execute_command("CONFIG GET", "maxmemory-policy")
        pipe.execute_command("HGET", text, "f", **{EMPTY_RESPONSE: "empty"})
        pipe.echo("7")

    redis_client.set_response_callback("ECHO", int)  # this test's client alone (each copies redis-py's)
    replies = execute(redis_client, lambda pipe: commands(pipe, f"replies-{uuid.uuid4().hex}"), raise_on_error=False)
    with redis_client.pipeline(transaction=False) as pipe:
        commands(pipe, f"replies-{uuid.uuid4().hex}")
        theirs = pipe.execute(raise_on_error=False)
    shown = [(type(r), str(r)) if isinstance(r, Exception) else r for r in replies]
    assert shown == [(type(r), str(r)) if isinstance(r, Exception) else r for r in theirs]
    assert shown[:2] == [1, 0] and shown[4:] == ["empty", 7]
    assert isinstance(replies[2], redis.ResponseError) and str(replies[2]).startswith("WRONGTYPE")
    assert list(shown[3]) == ["maxmemory-policy"]  # CONFIG GET's callback: a dict


def test_an_exchange_reads_the_reply_of_a_command_without_options_without_parse_response(redis_client, monkeypatch):
    """parse_response is entered only for a command recorded with options: for the others (a
    submit's CREATE and enqueue, most of a worker's) its option handling has nothing to do, and
    its frame and its second case-insensitive lookup of the callback were a Python call a reply
    on every round trip of every component."""
    import redis

    from producer_client.protocol.execution import execute

    def refused(*args, **kwargs):
        raise AssertionError("parse_response called")

    monkeypatch.setattr(redis.Redis, "parse_response", refused)
    key = f"plain-{uuid.uuid4().hex}"
    assert execute(redis_client, lambda pipe: [pipe.hsetnx(key, "f", "v"), pipe.hget(key, "f")]) == [True, "v"]


@pytest.mark.parametrize("name", ["hsetnx", "HSetNX"])
def test_a_plain_replys_callback_is_the_clients_for_its_name_in_any_case(redis_server, name):
    """A callback the caller set (redis-py upper-cases its name) is the one a plain reply goes
    through, found by dict's lookup of the upper-cased name (288b85c: CaseInsensitiveDict.get); a
    client whose callbacks are a plain dict is asked by its get."""
    import redis

    from producer_client.protocol.execution import execute

    key = f"callback-{uuid.uuid4().hex}"
    with redis.Redis.from_url(redis_server.url, decode_responses=True) as client:
        client.set_response_callback(name, lambda reply: ("set", reply))
        assert execute(
            client, lambda pipe: [pipe.hsetnx(key, "f", "v"), pipe.execute_command("hsetnx", key, "f", "w")]
        ) == [("set", 1), ("set", 0)]
        client.response_callbacks = {"HGET": lambda reply: ("plain", reply)}
        assert execute(client, lambda pipe: [pipe.hget(key, "f"), pipe.hsetnx(key, "f", "x")]) == [("plain", "v"), 0]


@pytest.mark.parametrize(
    ("worker", "started_at", "resumed_tokens"),
    [("bench-worker-0", 1_790_000_000.123456, 0), ('w\u00e9"\\', None, 5), ("w", 1e16, 12)],
)
def test_a_start_event_is_the_json_json_dumps_writes(worker, started_at, resumed_tokens):
    want = json.dumps({"worker": worker, "started_at": started_at, "resumed_tokens": resumed_tokens})
    assert encode_start(worker, started_at, resumed_tokens, None) == want
