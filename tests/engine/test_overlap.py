"""Overlapped scheduling: step N+1 is launched before step N's tokens are read, with exactly
the outputs of the synchronous engine.

The ordering tests use a fake model whose greedy next token is a function of the input token
and its position, so a wrong or stale input id changes every later token, and whose calls
land in one event log with the engine's reads of the draws.
"""

from types import SimpleNamespace

import pytest
import torch

from producer_client.schema import SamplingParams
from tests.engine.support import VOCAB
from tests.engine.test_engine import assert_all_pages_free_after_clear, random_prompts
from worker.engine import Engine, EngineSettings
from worker.engine.engine import overlap_enabled
from worker.model.parallel import SINGLE


def next_token(token: int, position: int) -> int:
    return (7 * token + position + 1) % VOCAB


def continuation(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq[-1], len(seq) - 1))
    return seq[len(prompt) :]


class FakeModel:
    """One-hot logits on next_token(input id, position); logs every forward's input ids."""

    def __init__(self, events: list):
        self.events = events
        self.model = SimpleNamespace(norm=SimpleNamespace(weight=torch.zeros(1)))  # the KV dtype
        self.tp = SINGLE  # one rank
        self.failures = 0  # calls still to fail, as a lost device would

    def __call__(self, input_ids, positions, meta, kv_caches, lora=None):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("device lost")
        self.events.append(("forward", input_ids.tolist()))
        return torch.stack([input_ids, positions], dim=1)

    def compute_logits(self, hidden, out=None):
        logits = torch.nn.functional.one_hot(next_token(hidden[:, 0], hidden[:, 1]), VOCAB).float()
        return logits if out is None else out.copy_(logits)

    def modules(self):
        return iter(())  # no LoRA adapter slots (worker.model.lora.lora_slots looks for them)


@pytest.fixture
def fake_engine(loaded):
    (_, config, _), tokenizer = loaded

    def make(overlap: bool, **settings) -> tuple[Engine, list]:
        events: list = []
        settings = {"num_pages": 64, "page_size": 4, "overlap_schedule": overlap, **settings}
        engine = Engine(FakeModel(events), config, tokenizer, EngineSettings.parse(**settings), [], torch.device("cpu"))
        read = engine.sampler.read

        def logged_read(sampled, requests):
            result = read(sampled, requests)
            events.append(("read", result.token_ids))
            return result

        engine.sampler.read = logged_read
        return engine, events

    return make


def drive(engine: Engine) -> list[list[tuple[str, list[int], bool]]]:
    """Steps until the engine is idle; per call, (request, new tokens, finished) of each output."""
    calls = []
    while engine.has_unfinished():
        calls.append([(o.request_id, o.new_token_ids, o.finished) for o in engine.step()])
    return calls


GREEDY3 = SamplingParams(temperature=0, max_tokens=3)


def test_step_n_plus_1_is_launched_on_tokens_the_host_has_not_read_yet(fake_engine):
    engine, events = fake_engine(overlap=True)
    prompt = [5, 6, 7]
    t1, t2, t3 = continuation(prompt, 3)
    engine.add_request("a", prompt, GREEDY3)
    assert drive(engine) == [[], [("a", [t1], False)], [("a", [t2], False)], [("a", [t3], True)]]
    assert events == [
        ("forward", prompt),
        ("forward", [t1]),
        ("read", [t1]),  # step 2 ran on t1 before the host read it
        ("forward", [t2]),
        ("read", [t2]),
        ("read", [t3]),  # t3 is the third of max_tokens=3: no step is run on it, its draw would be discarded
    ]
    assert_all_pages_free_after_clear(engine)


def test_the_synchronous_engine_reads_each_step_before_the_next(fake_engine):
    engine, events = fake_engine(overlap=False)
    prompt = [5, 6, 7]
    t1, t2, t3 = continuation(prompt, 3)
    engine.add_request("a", prompt, GREEDY3)
    assert drive(engine) == [[("a", [t1], False)], [("a", [t2], False)], [("a", [t3], True)]]
    assert events == [
        ("forward", prompt),
        ("read", [t1]),
        ("forward", [t1]),
        ("read", [t2]),
        ("forward", [t2]),
        ("read", [t3]),
    ]


def test_penalties_read_the_previous_step_before_scheduling(fake_engine):
    engine, events = fake_engine(overlap=True)
    prompt = [5, 6, 7]
    t1, t2, t3 = continuation(prompt, 3)  # one-hot logits: a repetition penalty keeps the argmax
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=3, repetition_penalty=1.5))
    assert drive(engine) == [[], [("a", [t1], False)], [("a", [t2], False)], [("a", [t3], True)]]
    assert events == [
        ("forward", prompt),
        ("read", [t1]),
        ("forward", [t1]),
        ("read", [t2]),
        ("forward", [t2]),
        ("read", [t3]),
    ]


def test_rows_of_a_batch_resolve_to_their_own_requests_tokens(fake_engine):
    prompts = [[1, 2], [300, 301, 302, 303, 304], [9]]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (4, 2, 6)]
    expected = [continuation(p, n.max_tokens) for p, n in zip(prompts, params)]
    engine, _ = fake_engine(overlap=True)
    outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert [o.usage.completion_tokens for o in outputs] == [4, 2, 6]
    assert_all_pages_free_after_clear(engine)


def test_a_token_in_flight_when_its_request_is_aborted_is_never_reported(fake_engine):
    engine, _ = fake_engine(overlap=True)
    t1 = continuation([5, 6, 7], 1)[0]
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10))
    assert drive_once(engine, 2) == [[], [("a", [t1], False)]]  # t2 is in flight
    assert engine.abort("a")
    (out,) = engine.step()
    assert (out.request_id, out.new_token_ids, out.finish_reason) == ("a", [], "abort")
    assert out.usage.completion_tokens == 1
    assert engine.step() == [] and not engine.has_unfinished()
    assert_all_pages_free_after_clear(engine)


def test_a_launch_that_raises_leaves_the_previous_step_in_flight_to_be_read_later(fake_engine):
    engine, events = fake_engine(overlap=True)
    prompt = [5, 6, 7]
    t1, t2 = continuation(prompt, 2)
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=2))
    assert engine.step() == []
    engine.runner.model.failures = 1
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert streams(drive(engine)) == {"a": ([t1, t2], True)}
    assert events == [("forward", prompt), ("forward", [t1]), ("read", [t1]), ("read", [t2])]


def drive_once(engine: Engine, calls: int) -> list:
    return [[(o.request_id, o.new_token_ids, o.finished) for o in engine.step()] for _ in range(calls)]


def test_a_request_preempted_with_a_token_in_flight_that_stops_it_ends_from_the_waiting_queue(fake_engine):
    a, b = [10, 11, 12, 13], [20, 21, 22, 23]
    b_stop = continuation(b, 1)[0]
    # Three pages of four tokens: each prompt fills one, and growing a into its second page
    # preempts b (less important) while b's first token, its stop token, is still in flight.
    results = {}
    for overlap in (True, False):
        engine, _ = fake_engine(overlap=overlap, num_pages=3)
        engine.add_request("a", a, SamplingParams(temperature=0, max_tokens=6), priority=0)
        engine.add_request("b", b, SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[b_stop]), priority=1)
        results[overlap] = streams(drive(engine)), engine.stats().preemptions
        assert_all_pages_free_after_clear(engine)
    assert results[True][0] == results[False][0] == {"a": (continuation(a, 6), True), "b": ([b_stop], True)}
    assert (results[True][1], results[False][1]) == (1, 0)


# A pool of two pages of four tokens holds the KV of 8 tokens: a 4-token prompt and the first 4 of
# its outputs; the 5th output is sampled from them, and a step on it would need a third page.
FULL_POOL = {"num_pages": 2}
PROMPT = [5, 6, 7, 8]


@pytest.mark.parametrize("case", ["length", "stop", "too long"])
def test_a_request_that_fills_the_pool_ends_as_the_synchronous_engine_ends_it(fake_engine, case):
    # Overlapped, a step on the 5th output would be launched before that token is read; it must not
    # turn an ending at max_tokens or at a stop token into kv_capacity_exceeded (seen on the GPU at
    # 32K, tests/engine/test_long_context.py), nor lose a token when the request does outgrow the pool.
    fifth = continuation(PROMPT, 5)[4]
    params = {
        "length": SamplingParams(temperature=0, max_tokens=5),
        "stop": SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[fifth]),
        "too long": SamplingParams(temperature=0, max_tokens=10),
    }[case]
    ends = {}
    for overlap in (True, False):
        engine, events = fake_engine(overlap=overlap, **FULL_POOL)
        (out,) = engine.generate([PROMPT], params)
        ends[overlap] = (out.token_ids, out.finish_reason, out.error and out.error.code)
        assert len([e for e in events if e[0] == "forward"]) == 5  # the prompt, then one step per output but the 5th
        assert_all_pages_free_after_clear(engine)
    assert (
        ends[True]
        == ends[False]
        == {
            "length": (continuation(PROMPT, 5), "length", None),
            "stop": (continuation(PROMPT, 5), "stop", None),
            "too long": (continuation(PROMPT, 5), "error", "kv_capacity_exceeded"),
        }[case]
    )


def streams(calls) -> dict[str, tuple[list[int], bool]]:
    """Each request's tokens over all calls, and whether it finished."""
    out: dict[str, tuple[list[int], bool]] = {}
    for call in calls:
        for request_id, tokens, finished in call:
            seen, _ = out.get(request_id, ([], False))
            out[request_id] = (seen + tokens, finished)
    return out


def assert_same_outputs(got, expected) -> None:
    """Equal tokens, text, endings and usage; logprobs to float precision, because an overlapped
    step may carry an extra (discarded) row and a GEMM's last bits depend on its row count."""
    for g, e in zip(got, expected, strict=True):
        assert (g.token_ids, g.text, g.finish_reason, g.usage, g.error) == (
            e.token_ids,
            e.text,
            e.finish_reason,
            e.usage,
            e.error,
        ), e.request_id
        assert (g.logprobs is None) == (e.logprobs is None)
        for gl, el in zip(g.logprobs or [], e.logprobs or [], strict=True):
            assert (gl.token_id, [t for t, _ in gl.top]) == (el.token_id, [t for t, _ in el.top])
            assert gl.logprob == pytest.approx(el.logprob, abs=1e-5)


def feature_params(stop_ids: list[int]) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=14),
        SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, seed=7, max_tokens=12),
        SamplingParams(temperature=1.3, seed=8, max_tokens=9),
        SamplingParams(temperature=0, max_tokens=10, logprobs=3),
        SamplingParams(temperature=0, max_tokens=11, stop_token_ids=stop_ids),
        SamplingParams(temperature=0, max_tokens=8, min_tokens=6, stop_token_ids=stop_ids),
        SamplingParams(temperature=0, max_tokens=13, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.7, seed=9, max_tokens=7, presence_penalty=0.8),
    ]


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({}, id="roomy"),
        pytest.param(  # preemption, chunked prefill
            {"num_pages": 20, "max_num_batched_tokens": 16, "max_running": 6},
            id="tight-and-chunked",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_overlapped_outputs_equal_the_synchronous_engines(make_engine, settings):
    prompts = random_prompts(6, 1, 40, seed=12)
    shared = random_prompts(1, 24, 24, seed=13)[0]
    prompts += [shared + p for p in random_prompts(4, 2, 9, seed=14)]  # prefix-cache hits
    greedy = make_engine().generate(prompts, SamplingParams(temperature=0, max_tokens=4))
    stop_ids = [greedy[4].token_ids[2], greedy[5].token_ids[1]]  # the stop_token_ids rows' own tokens
    params = (feature_params(stop_ids) * 2)[: len(prompts)]
    assert {"stop", "length"} <= {o.finish_reason for o in make_engine().generate(prompts, params)}

    synchronous = make_engine(overlap_schedule=False, **settings)
    overlapped = make_engine(overlap_schedule=True, **settings)
    assert (synchronous.overlap, overlapped.overlap) == (False, True)
    assert_same_outputs(overlapped.generate(prompts, params), synchronous.generate(prompts, params))
    # Again, from a warm prefix cache.
    assert_same_outputs(overlapped.generate(prompts[:4], params[:4]), synchronous.generate(prompts[:4], params[:4]))
    if settings:
        assert overlapped.stats().preemptions > 0
    assert_all_pages_free_after_clear(overlapped)


def test_overlap_follows_the_device_unless_set():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not overlap_enabled(EngineSettings(), cpu) and overlap_enabled(EngineSettings(), cuda)
    assert overlap_enabled(EngineSettings(overlap_schedule=True), cpu)
    assert not overlap_enabled(EngineSettings(overlap_schedule=False), cuda)
