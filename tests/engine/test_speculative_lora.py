"""Speculative decoding with LoRA adapters: the target verifies every drafted token with its
request's adapter (the verify step carries the batch's adapter rows, laid out for the verify graphs
too), so a batch that mixes adapters of different ranks and the base model generates, speculating,
exactly what the engine generates without speculation. The proposers draft without the adapters
(a draft model or an EAGLE-3 head of the base): that costs acceptance only."""

from unittest import mock

import pytest
import torch

from harness.model_configs import SMALL_DENSE
from producer_client.schema import SamplingParams
from tests.engine.speculative_support import ScriptedProposer, always_speculating
from tests.engine.support import VOCAB
from tests.engine.test_speculative import assert_same_outputs
from worker.engine import Engine, EngineSettings
from worker.engine.kv_pool import pages_for
from worker.engine.verify_graphs import VerifyGraphRunner
from worker.model.config import read_json
from worker.model.eagle3_checkpoint import write_random_eagle3_head
from worker.model.loader import load_model
from worker.model.presets import qwen3_config
from worker.model.random_adapter import write_random_adapter
from worker.model.tokenizer import Tokenizer

K = 4
ADAPTERS = {
    "a8": {"rank": 8, "seed": 1},
    "b16": {"rank": 16, "target_modules": ("q_proj", "v_proj", "down_proj"), "use_rslora": True, "seed": 2},
    "c32": {"rank": 32, "target_modules": ("k_proj", "o_proj", "gate_proj", "up_proj"), "seed": 3},
}
NAMES = [None, "a8", "b16", "c32", "a8", None]
PROMPTS = [torch.randint(0, VOCAB, (5 + 3 * i,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(6)]
PARAMS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 5 + [
    SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)
]
PARAMS[3] = SamplingParams(temperature=0.8, top_k=40, seed=3, max_tokens=12, ignore_eos=True)  # on adapter c32


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory) -> dict[str, str]:
    root, config = tmp_path_factory.mktemp("spec_adapters"), read_json(checkpoint / "config.json")
    return {name: str(write_random_adapter(root / name, config, **args)) for name, args in ADAPTERS.items()}


@pytest.fixture(scope="module")
def make_lora_engine(checkpoint, adapters):
    """An engine over a model of its own: each engine's adapter slots are the model's."""
    tokenizer = Tokenizer.from_dir(checkpoint)

    def make(**settings) -> Engine:
        model, config, _ = load_model(checkpoint, dtype=torch.float32)
        settings = {"num_pages": 256, "page_size": 4, "lora_modules": adapters, "max_lora_rank": 32, **settings}
        return Engine(model, config, tokenizer, EngineSettings.parse(**settings), [], torch.device("cpu"))

    return make


@pytest.fixture(scope="module")
def want(make_lora_engine):
    """The mixed batch's outputs without speculation; each adapter's differ from the base model's."""
    engine = make_lora_engine()
    outputs = engine.generate(PROMPTS, PARAMS, adapters=NAMES)
    assert [o.error for o in outputs] == [None] * len(NAMES)
    base = engine.generate(PROMPTS, PARAMS)
    assert [o.token_ids == b.token_ids for o, b in zip(outputs, base)] == [name is None for name in NAMES]
    return outputs


def verify_graphs(engine, max_batch: int) -> VerifyGraphRunner:
    """The verify graphs' runner, eager on CPU: each padded size runs the forward a graph replays."""
    pages = pages_for(engine.max_model_len + K + 1, engine.settings.page_size)
    return VerifyGraphRunner(engine.runner.model, engine.runner.kv_caches, max_batch, pages, K + 1, engine.device)


@pytest.mark.parametrize("layout", ["eager", "verify-graphs"])
def test_a_mixed_batch_of_adapters_speculating_generates_what_it_does_without(make_lora_engine, want, layout):
    engine = always_speculating(make_lora_engine(speculative_method="ngram", num_speculative_tokens=K, max_running=8))
    # Drafts of the adapters' own outputs, one token in three wrong: every verify step accepts some.
    known = {tuple(p): o.token_ids for p, o in zip(PROMPTS, want)}
    engine.speculator.proposer = ScriptedProposer(known, VOCAB, lambda position: position % 3 == 1)
    runner = engine.runner
    if layout == "verify-graphs":
        runner.verify_graphs = verify_graphs(engine, max_batch=8)
    with mock.patch.object(runner.model, "forward", wraps=runner.model.forward) as forwards:
        assert_same_outputs(engine.generate(PROMPTS, PARAMS, adapters=NAMES), want)
    stats = engine.stats()
    assert 0 < stats.accepted_draft_tokens < stats.draft_tokens
    verifies = [c.args[4] for c in forwards.call_args_list if c.args[2].max_q_len == K + 1]
    assert any(lora is not None for lora in verifies)  # verify steps ran adapter rows


@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_a_proposer_of_the_base_model_changes_no_output_under_adapters(
    make_lora_engine, want, checkpoint, tmp_path_factory, method
):
    model = str(checkpoint)
    if method == "eagle3":
        head = tmp_path_factory.mktemp("spec_lora_head")
        model = str(
            write_random_eagle3_head(head, qwen3_config(**SMALL_DENSE), "eagle", 700, seed=4, aux_layer_ids=[0, 0, 1])
        )
    engine = always_speculating(
        make_lora_engine(speculative_method=method, speculative_model=model, num_speculative_tokens=3)
    )
    assert_same_outputs(engine.generate(PROMPTS, PARAMS, adapters=NAMES), want)
    assert engine.stats().draft_tokens > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph capture needs a CUDA device")
def test_on_cuda_captured_verify_graphs_with_adapters_and_overlap_generate_what_the_cpu_engine_does(
    checkpoint, adapters, want
):
    settings = {"num_pages": 256, "page_size": 4, "max_running": 8, "lora_modules": adapters, "max_lora_rank": 32}
    fast = Engine.from_pretrained(
        checkpoint,
        device="cuda",
        dtype="float32",
        speculative_method="draft",
        speculative_model=str(checkpoint),
        **settings,
    )
    assert fast.runner.verify_graphs is not None and fast.overlap
    always_speculating(fast).warm_up()
    with mock.patch.object(fast.runner.verify_graphs, "run", wraps=fast.runner.verify_graphs.run) as replays:
        got = fast.generate(PROMPTS, PARAMS, adapters=NAMES)
    # Greedy rows token for token with the CPU engine (sampled ones draw on another device's generator).
    greedy = [i for i, p in enumerate(PARAMS) if p.temperature == 0]
    assert [got[i].token_ids for i in greedy] == [want[i].token_ids for i in greedy]
    assert any(call.args[0].lora is not None for call in replays.call_args_list)
    assert fast.stats().accepted_draft_tokens > 0
