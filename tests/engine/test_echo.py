"""The echo engine's lanes, as the model's scheduler has them: a higher lane's request preempts a
lower lane's running one for its slot or its pages, never one of its own lane, and every request
still ends with its whole echo."""

import gc

from producer_client.schema import SamplingParams
from worker.engine.echo import EchoEngine
from worker.engine.outputs import RequestOutput, TokenCounts
from worker.engine.settings import EngineSettings


def run(engine: EchoEngine, steps: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(steps):
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_a_higher_lane_preempts_the_newest_of_the_lowest_lane_and_every_echo_completes():
    engine = EchoEngine(EngineSettings(max_running=2))
    for name in ("f1", "f2"):
        engine.add_request(name, list(b"flex job"), SamplingParams(max_tokens=8), lane=2)
    first = run(engine, 2)
    engine.add_request("d1", list(b"dflt"), SamplingParams(max_tokens=4), lane=1)
    engine.add_request("d2", list(b"same"), SamplingParams(max_tokens=4), lane=1)
    later = run(engine, 1)
    assert sorted(later) == ["d1", "d2"]  # both flex requests gave their slots up, the newest first
    assert (engine.preemptions, list(engine.lanes[2])) == (2, ["f1", "f2"])
    rest = run(engine, 20)
    outputs = {k: first.get(k, []) + later.get(k, []) + rest.get(k, []) for k in ("f1", "f2", "d1", "d2")}
    assert outputs == {"f1": list(b"flex job"), "f2": list(b"flex job"), "d1": list(b"dflt"), "d2": list(b"same")}


def test_within_a_lane_a_request_waits_for_a_slot():
    engine = EchoEngine(EngineSettings(max_running=1))
    engine.add_request("a", list(b"aaaa"), SamplingParams(max_tokens=4), lane=1)
    run(engine, 1)
    engine.add_request("b", list(b"bbbb"), SamplingParams(max_tokens=4), priority=-5, lane=1)
    assert sorted(run(engine, 1)) == ["a"] and engine.preemptions == 0


def deltas(engine: EchoEngine) -> list[str]:
    return [o.text_delta for _ in range(64) for o in engine.step()]


def test_an_ascii_echo_gives_each_tokens_character_and_a_multibyte_one_whole_characters():
    engine = EchoEngine(EngineSettings())
    engine.add_request("ascii", list(b"plain text"), SamplingParams(max_tokens=6))
    assert deltas(engine) == list("plain ")
    engine.add_request("utf8", list("né ✓".encode()), SamplingParams(max_tokens=16))
    assert deltas(engine) == ["n", "", "é", " ", "", "", "✓"]  # a character once its last byte came


def test_a_resumed_echo_goes_on_after_its_given_tokens_with_their_decoding_state():
    engine = EchoEngine(EngineSettings())
    engine.add_request("ascii", list(b"abcdef"), SamplingParams(max_tokens=6), resume_token_ids=list(b"abc"))
    engine.add_request("utf8", list("a✓b".encode()), SamplingParams(max_tokens=8), resume_token_ids=[97, 0xE2])
    outputs = [o for _ in range(8) for o in engine.step()]
    texts = {rid: "".join(o.text_delta for o in outputs if o.request_id == rid) for rid in ("ascii", "utf8")}
    assert texts == {"ascii": "def", "utf8": "✓b"}
    assert {o.request_id: o.usage.completion_tokens for o in outputs if o.finished} == {"ascii": 6, "utf8": 5}


def test_a_steps_outputs_are_the_request_outputs_a_caller_would_make_the_last_ones_included():
    """A running request's next output is built in place (object.__new__, each slot set; see
    outputs.RequestOutput): each equals the one RequestOutput(...) makes, so a field added to
    RequestOutput and not set there fails this."""
    engine = EchoEngine(EngineSettings())
    engine.add_request("two", list(b"ab"), SamplingParams(max_tokens=2))
    engine.add_request("one", list(b"c"), SamplingParams(max_tokens=8))
    engine.add_request("utf8", list("é".encode()), SamplingParams(max_tokens=8))
    steps = [engine.step(), engine.step()]
    assert steps == [
        [
            RequestOutput("two", [97], "a", False, None, TokenCounts(2, 1, 0)),
            RequestOutput("one", [99], "c", True, "stop", TokenCounts(1, 1, 0)),
            RequestOutput("utf8", [0xC3], "", False, None, TokenCounts(2, 1, 0)),
        ],
        [
            RequestOutput("two", [98], "b", True, "length", TokenCounts(2, 2, 0)),
            RequestOutput("utf8", [0xA9], "é", True, "stop", TokenCounts(2, 2, 0)),
        ],
    ]
    assert not engine.has_unfinished() and engine.running_pages == 0


def token_counts_alive() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is TokenCounts)


def test_a_steps_token_outputs_make_no_token_counts_until_their_usage_is_read():
    """An output keeps its counts as ints (outputs.RequestOutput): a TokenCounts made for every
    output of every step, and freed after it, was about a third of the echo's work an output."""
    engine = EchoEngine(EngineSettings())
    for name in ("a", "b", "c"):
        engine.add_request(name, list(b"echo me"), SamplingParams(max_tokens=8))
    before = token_counts_alive()
    outputs = [o for _ in range(3) for o in engine.step()]
    assert len(outputs) == 9 and token_counts_alive() == before
    assert [o.usage for o in outputs[-3:]] == [TokenCounts(7, 3, 0)] * 3
