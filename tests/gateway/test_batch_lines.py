"""OpenAI's batch line format (openai_format/batch_lines.py), shared by `mili batch` and the Batch API:
what a line that is not a request is called, request ids, answers rendered from results, and
where a full queue splits the lines it was sent."""

import json
import uuid

import pytest

from gateway.batch.store import text_pieces
from openai_format.batch_lines import (
    LineError,
    LineJobs,
    answer,
    check_lines,
    line_request,
    parse_line,
    request_id,
    split_at_full_queue,
)
from openai_format.errors import APIError
from producer_client import BulkQueueFull, Client, JobResult
from producer_client.keys import NAME_PATTERN, NO_TENANT, Keys
from producer_client.schema import ErrorInfo, Usage

CHAT = "/v1/chat/completions"


def line(custom_id="a", url=CHAT, method="POST", **body) -> str:
    return json.dumps(
        {
            "custom_id": custom_id,
            "method": method,
            "url": url,
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body},
        }
    )


@pytest.mark.parametrize(
    "text, code, param",
    [
        ("{not json", "invalid_json", None),
        ("[1, 2]", "invalid_line", None),
        (json.dumps({"method": "POST", "url": CHAT, "body": {}}), "invalid_line", "custom_id"),
        (json.dumps({"custom_id": "", "method": "POST", "url": CHAT, "body": {}}), "invalid_line", "custom_id"),
        (line(method="GET"), "invalid_line", "method"),
        (json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": []}), "invalid_line", "body"),
        (
            json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": {}, "extra": 1}),
            "invalid_line",
            "extra",
        ),
        (line(url="/v1/embeddings"), "invalid_url", "url"),
    ],
)
def test_a_line_that_is_not_a_request_is_named_with_its_number(text, code, param):
    with pytest.raises(LineError) as bad:
        parse_line(text, 7)
    assert (bad.value.line, bad.value.code, bad.value.param) == (7, code, param)
    assert bad.value.error().line == 7


@pytest.mark.parametrize("text", ["[1, 2]", "3", '"a request"', "null"])
def test_a_line_of_json_that_is_no_object_says_so_in_words(text):
    """The error file's message for such a line read `None: Input should be an object`: the
    Python name of the missing field's place, where a field-less line has none."""
    with pytest.raises(LineError) as bad:
        parse_line(text, 2)
    assert bad.value.error().message == "the line is not a JSON object: Input should be an object"


def test_check_lines_names_every_bad_line_up_to_the_cap_and_skips_blank_ones():
    text = "\n".join([line("a"), "", line("b", url="/v1/completions"), line("a"), "{", line("c")])
    lines, errors = check_lines(text, CHAT, max_lines=10)
    assert len(lines) == 5
    assert [(e.line, e.code) for e in errors] == [(3, "invalid_url"), (4, "duplicate_custom_id"), (5, "invalid_json")]
    assert len(check_lines("{\n" * 300, CHAT, max_lines=1000, max_errors=100)[1]) == 100
    _, too_many = check_lines("\n".join(line(str(i)) for i in range(4)), CHAT, max_lines=3)
    assert [(e.line, e.code) for e in too_many] == [(4, "too_many_lines")]


def test_a_custom_id_of_a_line_that_is_no_request_is_a_duplicate_on_a_later_line():
    """Only a request line's custom_id was noted: a later line repeating that of a line refused
    (a bad method, another url) passed, and `mili batch` answered the custom_id twice."""
    text = "\n".join([line("a", method="GET"), line("b", url="/v1/completions"), "{", line("a"), line("b"), line("c")])
    _, errors = check_lines(text, CHAT, max_lines=10)
    assert [(e.line, e.code, e.custom_id) for e in errors] == [
        (1, "invalid_line", "a"),
        (2, "invalid_url", "b"),
        (3, "invalid_json", None),
        (4, "duplicate_custom_id", "a"),
        (5, "duplicate_custom_id", "b"),
    ]


def test_request_ids_depend_on_scope_custom_id_and_body_and_fit_a_job_id():
    base = request_id("s", "a", {"x": 1, "y": [1, 2]})
    assert base == request_id("s", "a", {"y": [1, 2], "x": 1})
    assert (
        len(
            {
                base,
                request_id("t", "a", {"x": 1, "y": [1, 2]}),
                request_id("s", "b", {"x": 1, "y": [1, 2]}),
                request_id("s", "a", {"x": 2, "y": [1, 2]}),
            }
        )
        == 4
    )
    assert NAME_PATTERN.fullmatch(f"{base}-127")


def test_a_lines_job_ids_begin_with_its_tenant_and_no_others():
    """A job's id is where its tenant is recorded (`<tenant>.`, up to the first dot): the gateway
    shows an API key its own jobs by it, and a producer user pinned to a tenant may touch the
    jobs whose ids begin so (docs/security.md). A batch line's ids began `batch.` whoever ran it:
    a pinned tenant's `mili batch` was refused its own jobs, and a tenant named `batch` owned
    every batch's jobs. A line of no tenant names none (no dot)."""
    tenant = "t" * 64  # the longest tenant name
    mine = request_id("s", "a", {"x": 1}, tenant)
    assert mine.startswith(f"{tenant}.") and NAME_PATTERN.fullmatch(f"{mine}-127")
    assert mine != request_id("s", "a", {"x": 1}, "other")
    assert "." not in request_id("s", "a", {"x": 1})


@pytest.mark.parametrize(
    "body, param",
    [
        ({"stream": True}, "stream"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"max_completion_tokens": 10**6, "n": 2}, "max_completion_tokens"),
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"temperature": "hot"}, "temperature"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format.json_schema.schema.uniqueItems",
        ),
        ({"guided_regex": "(?=a)"}, "guided_regex"),
    ],
)
def test_a_body_the_http_api_refuses_is_a_400_naming_the_field(body, param):
    with pytest.raises(APIError) as refused:
        line_request(parse_line(line(**body), 1), 1)
    assert refused.value.status == 400 and refused.value.body.error.param == param


def test_a_lines_structured_output_reaches_its_jobs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    request = line_request(
        parse_line(
            line(n=2, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}), 1
        ),
        1,
    )
    assert [s.sampling["response_format"]["json_schema"]["schema"] for s in request.specs] == [schema, schema]
    guided = line_request(parse_line(line(guided_choice=["yes", "no"]), 1), 1)
    assert guided.specs[0].sampling["response_format"] == {"type": "choice", "choices": ["yes", "no"]}


def result(job_id: str, status="done", text="ok", code=None, finish_reason="stop") -> JobResult:
    return JobResult(
        id=job_id,
        status=status,
        text=text,
        finish_reason=finish_reason,
        error=ErrorInfo(code=code, message="why") if code else None,
        usage=Usage(prompt_tokens=3, completion_tokens=2),
    )


def jobs_of(text: str) -> LineJobs:
    return LineJobs(line_request(parse_line(text, 1), 1), "rid")


def test_answers_are_the_http_apis_own():
    two = jobs_of(line(n=2))
    assert not two.add(result("rid-1", text="second"))
    assert two.add(result("rid-0", text="first"))
    ok = answer(two.request, two.request_id, two.in_choice_order())
    assert ok.ok and ok.response.status_code == 200 and ok.response.request_id == "rid"
    assert [c["message"]["content"] for c in ok.response.body["choices"]] == ["first", "second"]
    assert ok.response.body["usage"]["completion_tokens"] == 4 and ok.completion_tokens() == 4

    single = jobs_of(line())
    for status, code, finish, expected in (
        ("failed", "prompt_too_long", "error", 400),
        ("failed", "internal", "error", 500),
        ("expired", None, "timeout", 504),
    ):
        failed = answer(single.request, "rid", [result("rid-0", status=status, code=code, finish_reason=finish)])
        assert not failed.ok and failed.response.status_code == expected
        assert failed.response.body["error"]["message"]
    too_long = answer(single.request, "rid", [result("rid-0", status="failed", code="prompt_too_long")])
    assert (too_long.response.body["error"]["param"], too_long.response.body["error"]["code"]) == (
        "messages",
        "context_length_exceeded",
    )


# JSON allows these raw inside a string; str.splitlines takes each for a line's end.
LINE_BOUNDARIES_JSON_ALLOWS = ["\u2028", "\u2029", "\x85"]


def test_batch_lines_split_on_newlines_only_and_keep_their_numbers():
    prompts = [f"a{sep}b" for sep in LINE_BOUNDARIES_JSON_ALLOWS]
    lines = [
        json.dumps(
            {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": p}},
            ensure_ascii=False,
        )
        for i, p in enumerate(prompts)
    ]
    text = "\r\n".join(lines) + "\r\n" + "not json\n"  # a CRLF file, and a bad line after them
    valid, errors = check_lines(text, "/v1/completions", max_lines=10)
    assert [parse_line(line, 1).body["prompt"] for line in valid[:3]] == prompts
    assert [(e.line, e.code) for e in errors] == [(4, "invalid_json")]
    assert "".join(text_pieces(text)) == text  # stored as uploaded


def test_a_line_with_a_control_character_json_forbids_raw_is_one_bad_line_with_its_number():
    text = '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n{"custom_id": "b\x0cc"}\nok\n'
    _, errors = check_lines(text, "/v1/completions", max_lines=10)
    assert [(e.line, e.code) for e in errors] == [(2, "invalid_json"), (3, "invalid_json")]


def specs_of(lines: list[LineJobs]) -> list[dict]:
    return [spec for line in lines for spec in line.submit_specs()]


def test_a_full_queue_lets_through_the_lines_it_took_whole_and_a_half_taken_line_waits_whole(
    redis_server, redis_client
):
    """Both batch runners' split: 4 lines of 2 choices against a queue bound of 3 jobs. The queue
    takes 3 jobs, all of line 1 and half of line 2: line 1 goes on, lines 2-4 wait, and sent again
    once there is room they add the 5 jobs left out, not line 2's first one twice."""
    queue = f"split-{uuid.uuid4().hex[:8]}"
    lines = [LineJobs(line_request(parse_line(line(f"c{i}", n=2), i + 1), i + 1), f"rid{i}") for i in range(4)]
    with Client(redis_server.url, queue, max_queue_depth=3) as bounded:
        with pytest.raises(BulkQueueFull) as full:
            bounded.submit_many(specs_of(lines))
    assert full.value.job_ids == ["rid0-0", "rid0-1", "rid1-0"]
    taken, waiting = split_at_full_queue(lines, full.value)
    assert taken == lines[:1] and waiting == lines[1:]
    with Client(redis_server.url, queue, max_queue_depth=None) as unbounded:
        assert unbounded.submit_many(specs_of(waiting)) == [job_id for line in waiting for job_id in line.job_ids]
    flex = Keys().lane_stream(queue, "flex", NO_TENANT)  # batch lines' default lane
    assert redis_client.xinfo_stream(flex)["entries-added"] == 8


def test_batch_lines_go_to_the_flex_lane_unless_their_body_names_a_tier():
    assert [spec["service_tier"] for spec in jobs_of(line(n=2)).submit_specs()] == ["flex", "flex"]
    assert [spec["service_tier"] for spec in jobs_of(line(service_tier="priority")).submit_specs()] == ["priority"]
    body = {"model": "m", "prompt": "hi"}
    completion = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": body})
    assert [spec["service_tier"] for spec in jobs_of(completion).submit_specs()] == ["flex"]


def test_a_queue_full_before_the_first_job_makes_every_line_wait():
    lines = [jobs_of(line(f"c{i}")) for i in range(3)]
    assert split_at_full_queue(lines, BulkQueueFull("q", 5, 5, [])) == ([], lines)
