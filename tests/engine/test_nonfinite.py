"""A NaN or an infinity in one request's logits fails that request alone, with code
nonfinite_logits and the output it had; the other rows of the batch run on as if alone."""

import pytest
import torch

from producer_client.schema import SamplingParams
from tests.engine.test_engine import assert_all_pages_free_after_clear, random_prompts

VICTIM = SamplingParams(temperature=0, max_tokens=8)
SURVIVOR = SamplingParams(temperature=0.8, seed=1, max_tokens=8, logprobs=2)


def poison(engine, request_id: str, at_output_token: int, value: float) -> None:
    """Makes the model's logits for `request_id`'s `at_output_token`-th token hold `value`
    (in one element), as a numerical fault in the model would."""
    sample = engine.sampler.sample
    draws = 0  # counted here: an overlapped engine's token list also holds a token in flight

    @torch.inference_mode()
    def faulty_sample(logits, requests, mask=None):
        nonlocal draws
        for row, req in enumerate(requests):
            if req.request_id == request_id:
                draws += 1
                if draws == at_output_token:
                    logits[row, 7] = value
        return sample(logits, requests, mask)

    engine.sampler.sample = faulty_sample


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    tokens = {request_id: [] for request_id in requests}
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
    return {request_id: (tokens[request_id], finals[request_id]) for request_id in requests}


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("overlap", [False, True])
def test_nonfinite_logits_fail_only_their_request(make_engine, overlap, value):
    victim_prompt, survivor_prompt = random_prompts(2, 5, 20, seed=4)
    alone = {
        name: run(make_engine(overlap_schedule=overlap), {name: spec})[name]
        for name, spec in {"victim": (victim_prompt, VICTIM), "survivor": (survivor_prompt, SURVIVOR)}.items()
    }
    engine = make_engine(overlap_schedule=overlap)
    poison(engine, "victim", at_output_token=3, value=value)
    both = run(engine, {"victim": (victim_prompt, VICTIM), "survivor": (survivor_prompt, SURVIVOR)})

    tokens, final = both["victim"]
    assert tokens == alone["victim"][0][:2]  # the output before the fault, nothing drawn from it
    assert final.finish_reason == "error"
    assert final.error.code == "nonfinite_logits" and "non-finite logits" in final.error.message
    assert final.usage.completion_tokens == 2

    tokens, final = both["survivor"]
    assert tokens == alone["survivor"][0] and len(tokens) == SURVIVOR.max_tokens
    assert final.finish_reason == "length" and final.error is None
    assert_all_pages_free_after_clear(engine)
