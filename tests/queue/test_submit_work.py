"""A submit's own work without Redis (branch y/submit3, issue 43's submit row): the body a job is sent
with, joined by hand for a prompt's job, is pydantic's text byte for byte; the Python calls of
building a job and of deciding where it goes stay few (bench/instructions.py counts them in
instructions: bench/RESULTS.md, "A submit's own work, by instructions (y/submit3)")."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import Any

import pytest
import redis
from redis.exceptions import NoScriptError, ResponseError

from producer_client import Client
from producer_client.cluster import AsyncCluster, Cluster, is_cluster
from producer_client.errors import InvalidArgument, MiliError
from producer_client.keys import DEFAULT_LANE, LANES, NO_TENANT, Keys
from producer_client.new_job import NewJob, build_job, estimated_tokens
from producer_client.placement import Placed, Placement, View, prefix_key
from producer_client.protocol import execution
from producer_client.protocol import producer as protocol
from producer_client.protocol.execution import _lacking_scripts, recorder
from producer_client.protocol.replies import Enqueued, Refusal, UnknownReply, parse_enqueue
from producer_client.quotas import Quotas
from producer_client.rate_limits import NO_RATE_LIMITS, RateLimits
from producer_client.schema import MAX_BODY_BYTES, PROMPT_JOB_DEFAULTS, JobRequest, SamplingParams
from producer_client.sharing import goes_to_queue_stream, rate_limits_of, uses_queue_stream

PROMPTS = [
    "hello",
    'quotes " and \\ backslashes',
    "".join(chr(i) for i in range(1, 64)),  # every control character JSON escapes
    "é 中文 😀 \u2028\u2029 \x7f \x80",
    "x" * 5000,
]
PARAMS = [
    SamplingParams(),
    SamplingParams(max_tokens=1, temperature=0.0),
    SamplingParams(stop=["a\n"], top_p=0.5, seed=3, temperature=1e-5),
    SamplingParams(max_tokens=256),  # its default, set: the body leaves it out
]


def pydantic_body(request: JobRequest) -> str:
    return request.__pydantic_serializer__.to_json(request, exclude_defaults=True).decode()


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("params", PARAMS)
def test_a_prompt_jobs_body_is_pydantics_text_byte_for_byte(prompt, params):
    request = JobRequest(prompt=prompt, params=params)
    assert request.to_json() == pydantic_body(request)
    assert request.to_json() == pydantic_body(request)  # the params' JSON kept from the first


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt": "p", "priority": 3},
        {"prompt": "p", "timeout_s": 1.5},
        {"prompt": "p", "stream": True},
        {"prompt": "p", "adapter": "a"},
        {"input_ids": [1, 2]},
        {"messages": [{"role": "user", "content": "hi"}], "enable_thinking": False},
    ],
)
def test_a_job_with_another_field_set_has_pydantics_body(fields):
    request = JobRequest(**fields, params=SamplingParams(max_tokens=2))
    assert request.to_json() == pydantic_body(request)
    assert JobRequest.from_json(request.to_json(), 1 << 20, 32768) == request


def python_calls(call: Callable[[], Any]) -> int:
    """The Python functions `call` enters (sys.setprofile's `call` events), itself not counted. The
    cyclic collector is run before and kept off during it: a collection there runs the finalizers
    of what earlier tests dropped (a redis-py client's __del__ and its connections', 24 calls)."""
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
        gc.enable()
    return calls - 1


def test_building_a_prompt_job_makes_few_python_calls():
    known: dict = {}
    build = lambda: build_job("a prompt", None, None, None, None, 0, {"max_tokens": 1}, known_params=known)  # noqa: E731
    build()  # the params validated, and their JSON kept
    # 759db3b: 20 (a model attribute read through pydantic's __getattr__ is no Python call; the
    # params' comparison with the defaults and the memo key's comprehension are).
    assert python_calls(build) <= 18


def test_a_plain_prompts_job_is_built_without_its_job_request(monkeypatch):
    """A plain prompt's job (a str prompt, sampling parameters, every other field at its default,
    no request_id): its JobRequest is neither validated nor made (failed at 2dd42c8: it was)."""

    def refuse(data: dict) -> JobRequest:
        raise AssertionError("a JobRequest validated")

    monkeypatch.setattr(JobRequest, "strictly_validated", refuse)
    job = build_job("a prompt", None, None, None, None, 0, {"max_tokens": 1, "temperature": 0.0}, known_params={})
    assert job.body == '{"prompt":"a prompt","params":{"max_tokens":1,"temperature":0.0}}'
    with pytest.raises(AssertionError):  # a job of another kind still is
        build_job("a prompt", None, None, None, None, 1, {"max_tokens": 1}, known_params={})


PLAIN_SAMPLING = [
    {},
    {"max_tokens": 1, "temperature": 0.0},
    {"stop": ["a\n"], "top_p": 0.5, "seed": 3, "min_tokens": 2},
    {"max_tokens": 256},  # its default, given
    {"response_format": {"type": "regex", "pattern": "[ab]+"}},
]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("sampling", PLAIN_SAMPLING)
@pytest.mark.parametrize("known", [None, {}])
def test_a_plain_prompts_job_is_the_one_its_job_request_gives(prompt, sampling, known):
    """The same body (pydantic's text), cost, prefix key and fields as the job built from its JobRequest."""
    request = JobRequest(prompt=prompt, params=SamplingParams(**sampling))
    for _ in range(2):  # the params validated, then from the memo
        job = build_job(prompt, None, None, None, None, 0, dict(sampling), known_params=known, tenant="acme")
        assert job.body == pydantic_body(request)
        assert job.cost == estimated_tokens(request, job.body)
        assert job.prefix == prefix_key(request)
        assert job.job_id.startswith("acme.") and len(job.job_id) == len("acme.") + 32
        assert job._replace(job_id="", body="", cost=0, prefix=b"") == NewJob("", "", False, 0, "", b"", None)


@pytest.mark.parametrize(
    "prompt, sampling",
    [
        ("p", {"max_tokens": 40000}),  # over MAX_TOKENS_LIMIT
        ("p", {"max_tokens": 0}),
        ("p", {"min_tokens": 5, "max_tokens": 2}),
        ("p", {"stop": [""]}),
        ("p", {"stop": ["x" * 300]}),
        ("p", {"stop_token_ids": [-1]}),
        ("p", {"temperature": "hot"}),
        ("p", {"bogus": 1}),
        ("p", {"max_tokens": 40000, "min_tokens": -1}),  # the schema's error first
        ("p", {"response_format": {"type": "regex", "pattern": "(("}}),
        ("p", {"response_format": {"type": "regex", "pattern": "a"}, "stop": ["x"]}),
        ("x" * MAX_BODY_BYTES, {}),  # a body over the limit
    ],
)
def test_a_plain_prompts_job_is_refused_as_its_job_request_is(prompt, sampling):
    """Each refusal, in the same order, as that of the same job built from its JobRequest (a
    request_id's job, built through it)."""
    with pytest.raises(MiliError) as plain:
        build_job(prompt, None, None, None, None, 0, dict(sampling), known_params={})
    with pytest.raises(MiliError) as through_request:
        build_job(prompt, None, None, "rid", None, 0, dict(sampling), known_params={})
    assert type(plain.value) is type(through_request.value)
    assert str(plain.value) == str(through_request.value)


@pytest.mark.parametrize(
    "prompt, priority, stream",
    [("", 0, False), (None, 0, False), (b"p", 0, False), ("p", False, False), ("p", 0.0, False), ("p", 0, 0)],
)
def test_what_is_no_plain_prompt_is_judged_by_its_job_request(prompt, priority, stream):
    """An empty prompt, none, or a field equal to its default but of another type: refused by the
    schema as before (strict: priority=False is no int, stream=0 no bool)."""
    with pytest.raises(InvalidArgument):
        build_job(prompt, None, None, None, None, priority, {}, stream=stream, known_params={})


def test_job_request_is_what_a_plain_prompts_job_assumes():
    """is_plain_prompt's premises: JobRequest's one rule of a str prompt is min_length=1, no validator
    of its own runs, and the fields a plain prompt leaves out default to what it checks they hold."""
    prompt = JobRequest.model_fields["prompt"]
    assert prompt.annotation == str | None and [type(m).__name__ for m in prompt.metadata] == ["MinLen"]
    assert prompt.metadata[0].min_length == 1
    decorators = JobRequest.__pydantic_decorators__
    assert not decorators.field_validators and not decorators.model_validators and not decorators.validators
    assert {k: PROMPT_JOB_DEFAULTS[k] for k in ("messages", "input_ids", "priority", "timeout_s", "stream")} == {
        "messages": None,
        "input_ids": None,
        "priority": 0,
        "timeout_s": None,
        "stream": False,
    }


def test_a_queue_of_one_worker_or_none_sends_jobs_to_the_shared_stream_without_reading_placement():
    placement = Placement()
    assert not placement.shared_now("q", 1)  # no view yet: streams_for reads it
    placement.views["q"] = View(float("inf"), [])  # fresh, no worker to choose
    assert placement.shared_now("q", 2)
    assert placement.placed == {Placed.AFFINITY: 0, Placed.SHARED: 2}
    placement.views["q"] = View(0.0, [])  # stale
    assert not placement.shared_now("q", 1)
    off = Placement(enabled=False)
    assert off.shared_now("q", 1) and off.placed[Placed.SHARED] == 1


def test_a_submit_to_a_queue_without_workers_makes_few_python_calls(redis_server, queue):
    """Client.submit, no tenant, no worker (placement's view fresh and empty): its Python calls,
    the round trip's included. The view is kept fresh for the test: past REFRESH_S (0.5 s, which a
    loaded machine's warm-up and collection can outlast) a submit reads it again, ~56 calls more."""
    with Client(redis_server.url, queue=queue) as client:
        client.placement.refresh_s = 3600  # the view read once: not again past REFRESH_S on a loaded machine
        for i in range(3):  # the scripts loaded, the view read, the params validated
            client.submit(f"warm {i}", max_tokens=1, temperature=0.0)
        # 759db3b: 99 (the placement's and the quota's generators, the frozen dataclasses' __init__,
        # the commands recorder's __init__, besides build_job's above). 288b85c: 94 (redis-py's
        # hsetnx, evalsha and _evalsha methods, ABCMeta's two subclass checks, the single job's
        # lane test's generator, the NOSCRIPT scan's comprehension, the callbacks' get per reply).
        # 2993be3: 84 (topology_errors' __enter__ and __exit__ and _send around one server's
        # exchange, _checked's call where nothing is raised, _packed's comprehension).
        assert python_calls(lambda: client.submit("a prompt", max_tokens=1, temperature=0.0)) <= 79


def test_a_tenants_submit_to_a_lane_makes_few_python_calls(redis_server, queue):
    """Client.submit of a tenant without limits to the flex lane (ENQUEUE_LANES), no worker: its
    Python calls, the round trip's included. A tenant of its own (no other test sets its quotas), whose
    settings the client reads once (not again past CACHE_S on a loaded machine)."""
    with Client(redis_server.url, queue=queue, tenant=f"solo-{queue}") as client:
        client.quota_cache = Quotas(cache_s=3600)
        client.placement.refresh_s = 3600  # as the quotas: the view read once
        for i in range(3):  # the scripts loaded, the view read, the quotas read, the params validated
            client.submit(f"warm {i}", max_tokens=1, temperature=0.0, service_tier="flex")
        # 2993be3: 129 (ENQUEUE_LANES' ten keys named at every submit, by 14 calls and two
        # generators; its arguments by a generator; LaneJob's and Enqueued's dataclass __init__;
        # the refusal by Refusal(text), Enum's three calls; rate limits of six 0 read by a generator
        # into a dataclass; with the plain submit's five above).
        submit = lambda: client.submit("a prompt", max_tokens=1, temperature=0.0, service_tier="flex")  # noqa: E731
        assert python_calls(submit) <= 84


def test_an_exchange_on_one_server_makes_few_python_calls(redis_server):
    """execution.execute of one PING (every component's round trips go this way): no cluster's
    context, no NOSCRIPT reload and no check of errors where none is raised."""
    with Client(redis_server.url, queue="q") as client:
        ping = lambda: execution.execute(client.redis, lambda pipe: pipe.execute_command("PING"))  # noqa: E731
        for _ in range(2):
            assert ping() == [True]
        assert python_calls(ping) <= 27  # 2993be3: 31


def test_a_script_call_and_a_fresh_create_record_what_redis_pys_methods_record():
    """The same commands, argument for argument, as evalsha and hsetnx made them (288b85c)."""
    keys = Keys()
    call = protocol.enqueue(keys.queue("q"), 7, "job-1", '{"prompt":"x"}')
    ours, theirs = recorder(), recorder()
    call.add_to(ours)
    protocol.add_fresh_create(ours, keys, "job-1", 0)
    theirs.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
    theirs.hsetnx(keys.job("job-1"), "status", "queued")
    assert ours.stack == theirs.stack


@pytest.mark.parametrize("lane", [DEFAULT_LANE, "batch"])
@pytest.mark.parametrize("tenant", [NO_TENANT, "acme"])
def test_one_jobs_queue_stream_answer_is_the_lists(lane, tenant):
    job = build_job("a prompt", None, None, None, None, 0, {"max_tokens": 1}, known_params={})._replace(lane=lane)
    assert goes_to_queue_stream(job, tenant) == uses_queue_stream([job], tenant)


def test_is_cluster_answers_by_class_each_time():
    class OwnCluster(Cluster):
        pass

    plain, cluster = object.__new__(redis.Redis), object.__new__(OwnCluster)
    for _ in range(2):  # the second answer is the kept one
        assert not is_cluster(plain)
        assert is_cluster(cluster)
        assert is_cluster(object.__new__(AsyncCluster))


def test_the_noscript_scan_finds_every_refused_script_in_order():
    replies = [1, NoScriptError("NOSCRIPT"), ResponseError("WRONGTYPE"), NoScriptError("NOSCRIPT"), None]
    assert _lacking_scripts(replies) == [1, 3]
    assert _lacking_scripts([]) == []


def test_enqueue_lanes_keys_are_the_keys_of_their_prefix_queue_and_tenant(monkeypatch):
    """ENQUEUE_LANES' ten keys, named once per prefix, queue and tenant: the names Keys gives, in
    the script's order, for each; the memo starts again empty past ENQUEUE_LANES_KEYS_KEPT."""
    monkeypatch.setattr(protocol, "_ENQUEUE_LANES_KEYS", {})
    monkeypatch.setattr(protocol, "ENQUEUE_LANES_KEYS_KEPT", 2)
    for _ in range(2):  # the second time from the memo (or named again after it was emptied)
        for keys, queue, tenant in [(Keys(), "q", "acme"), (Keys("other"), "q", "acme"), (Keys(), "q", NO_TENANT)]:
            assert protocol.enqueue_lanes_keys(keys, queue, tenant) == (
                keys.scheduler(queue),
                keys.lane_streams(queue),
                keys.doorbell(queue),
                keys.rate(queue, tenant),
                *(keys.lane(queue, lane) for lane in LANES),
                *(keys.lane_stream(queue, lane, tenant) for lane in LANES),
            )
            assert len(protocol._ENQUEUE_LANES_KEYS) <= 2
    jobs = [protocol.LaneJob("flex", 5, "a", "{}"), protocol.LaneJob(DEFAULT_LANE, 3, "b", "{}", 0, 9)]
    call = protocol.enqueue_lanes(Keys(), "q", "acme", jobs, 10)
    assert call.keys == protocol.enqueue_lanes_keys(Keys(), "q", "acme")
    flex, default = LANES.index("flex") + 1, LANES.index(DEFAULT_LANE) + 1
    assert call.args[8:] == (flex, 5, 1, 5, "a", "{}", default, 3, 0, 9, "b", "{}")


@pytest.mark.parametrize("refusal", list(Refusal))
def test_an_enqueue_lanes_refusal_is_read_by_its_text(refusal):
    reply = [0, refusal.value, 3, "x", 0, 0, 0, 0, 0, 0]
    assert parse_enqueue(reply) == Enqueued(0, refusal, (3, "x"), (0, 0, 0, 0, 0, 0))
    assert parse_enqueue(reply).refusal is refusal


@pytest.mark.parametrize("text", ["nope", None, 1, ["full"]])
def test_an_enqueue_lanes_refusal_of_no_known_text_is_an_unknown_reply(text):
    with pytest.raises(UnknownReply):
        parse_enqueue([0, text, 3, "x", 0, 0, 0, 0, 0, 0])


def test_rate_limits_of_six_zeros_are_no_rate_limits_and_others_are_read():
    assert rate_limits_of(Enqueued(1, Refusal.NONE, (0, ""), (0, 0, 0, 0, 0, 0))) == NO_RATE_LIMITS
    assert rate_limits_of(Enqueued(1)) == NO_RATE_LIMITS
    assert rate_limits_of(Enqueued(1, Refusal.NONE, (0, ""), (10, 9, 6000, 0, 0, 0))) == RateLimits(10, 9, 6.0)
    assert rate_limits_of(Enqueued(1, Refusal.NONE, (0, ""), (0, 0, 0, 0, 0, 1))).reset_tokens_s == 0.001
