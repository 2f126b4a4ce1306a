"""LoRA adapters through the engine: a batch that mixes adapters and the base model generates what
transformers + peft generate for each; the prefix cache never hands one adapter's KV to another;
more adapters than slots under load all run (their jobs wait for a slot, never fail); reading an
adapter from disk never holds a step back; an adapter the loader refuses ends its jobs only."""

import shutil
import threading
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from producer_client.errors import UnknownAdapter
from producer_client.schema import SamplingParams
from tests.engine.support import VOCAB
from worker.engine import Engine, EngineSettings
from worker.engine.cuda_graph import DecodeGraphRunner
from worker.engine.kv_pool import pages_for
from worker.engine.request import RequestStatus
from worker.model.config import read_json
from worker.model.loader import load_model
from worker.model.lora_adapter import WEIGHTS_FILE
from worker.model.random_adapter import write_random_adapter
from worker.model.tokenizer import Tokenizer

MAX_RANK = 64
# name -> write_random_adapter's arguments: ranks 8 to 64, different targets.
ADAPTERS = {
    "a8": {"rank": 8, "seed": 1},
    "b16": {"rank": 16, "target_modules": ("q_proj", "v_proj", "down_proj"), "use_rslora": True, "seed": 2},
    "c64": {"rank": 64, "target_modules": ("k_proj", "o_proj", "gate_proj", "up_proj"), "seed": 3},
    "d8": {"rank": 8, "target_modules": ("q_proj",), "seed": 4},
    "e32": {"rank": 32, "seed": 5},
    "f16": {"rank": 16, "target_modules": ("v_proj", "o_proj"), "seed": 6},
}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def base_config(checkpoint) -> dict:
    return read_json(checkpoint / "config.json")


@pytest.fixture(scope="module")
def adapters(base_config, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: str(write_random_adapter(root / name, base_config, **args)) for name, args in ADAPTERS.items()}


@pytest.fixture(scope="module")
def make_lora_engine(checkpoint, adapters):
    """An engine over a model of its own: each engine's adapter slots are the model's."""
    tokenizer = Tokenizer.from_dir(checkpoint)

    def make(**settings) -> Engine:
        model, config, _ = load_model(checkpoint, dtype=torch.float32)
        settings = {
            "num_pages": 256,
            "page_size": 4,
            "lora_modules": adapters,
            "max_lora_rank": MAX_RANK,
            **settings,
        }
        return Engine(model, config, tokenizer, EngineSettings.parse(**settings), [], torch.device("cpu"))

    return make


@pytest.fixture(scope="module")
def peft_greedy(checkpoint, adapters):
    """Greedy tokens from transformers with the adapter loaded by peft (None: the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    models = {}

    def model(adapter):
        if adapter not in models:
            base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
            models[adapter] = (base if adapter is None else PeftModel.from_pretrained(base, adapters[adapter])).eval()
        return models[adapter]

    @torch.inference_mode()
    def greedy(prompt: list[int], adapter: str | None, max_new_tokens: int = GREEDY.max_tokens) -> list[int]:
        ids = torch.tensor([prompt])
        out = model(adapter).generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
        return out[0, len(prompt) :].tolist()

    return greedy


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_batch_mixing_adapters_and_the_base_generates_what_peft_generates(make_lora_engine, peft_greedy):
    engine = make_lora_engine(max_loras=3)
    names = [None, "a8", "b16", "c64", "a8", None]
    prompts = [prompt(i, 5 + 3 * i) for i in range(len(names))]
    outs = engine.generate(prompts, GREEDY, adapters=names)
    assert [o.error for o in outs] == [None] * len(names)
    assert [o.token_ids for o in outs] == [peft_greedy(p, a) for p, a in zip(prompts, names)]
    assert len({tuple(o.token_ids) for o in outs[:4]}) > 1  # the adapters change the output


def test_a_prefix_cached_under_the_base_is_never_reused_under_an_adapter(make_lora_engine, peft_greedy):
    engine = make_lora_engine(max_loras=2)
    p = prompt(42, 21)  # 5 whole pages of 4 before the last token
    base = engine.generate([p], GREEDY)[0]
    under_a = engine.generate([p], GREEDY, adapters=["a8"])[0]
    again = engine.generate([p], GREEDY, adapters=["a8"])[0]
    assert base.token_ids == peft_greedy(p, None)
    assert under_a.token_ids == again.token_ids == peft_greedy(p, "a8")
    assert under_a.usage.cached_prompt_tokens == 0  # the base's pages were not its own
    assert again.usage.cached_prompt_tokens == 20  # its own adapter's were


def run_to_end(engine: Engine, requests: dict[str, tuple[list[int], str | None]]) -> dict[str, list[int]]:
    """Adds the requests at once and steps until all have ended, checking at every step that each
    running request's adapter is the one in its slot."""
    for rid, (p, name) in requests.items():
        engine.add_request(rid, p, GREEDY, adapter=name)
    tokens = {rid: [] for rid in requests}
    ended = set()
    while len(ended) < len(requests):
        for out in engine.step():
            assert out.error is None
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                ended.add(out.request_id)
        held = engine.lora.slots.holders
        for req in engine.scheduler.running:
            assert req.adapter is None or held[req.adapter.slot] is req.adapter
    return tokens


def test_more_adapters_than_slots_under_load_all_run_and_match_peft(make_lora_engine, peft_greedy):
    engine = make_lora_engine(max_loras=2, max_cpu_loras=3, max_running=8)
    names = [None, *ADAPTERS]
    slots = engine.lora.slots
    for wave in range(2):
        before = slots.installs
        requests = {f"w{wave}r{i}": (prompt(100 * wave + i, 4 + i % 5), names[i % len(names)]) for i in range(21)}
        tokens = run_to_end(engine, requests)
        assert tokens == {rid: peft_greedy(p, name) for rid, (p, name) in requests.items()}
        # Each adapter is installed at most once a wave (its jobs wait together: the slots do not
        # thrash), and all but the two the slots still held are installed again in the second.
        assert len(ADAPTERS) - 2 * wave <= slots.installs - before <= len(ADAPTERS)
    # The host cache holds 3: the second wave read at least the 3 it had dropped from disk again.
    assert engine.lora.loader.reads >= len(ADAPTERS) + 3
    assert engine.stats().adapter_reads == engine.lora.loader.reads


def test_a_job_whose_adapter_cannot_get_a_slot_waits_while_others_run(make_lora_engine):
    engine = make_lora_engine(max_loras=1)
    engine.add_request(
        "long", prompt(1, 6), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), adapter="a8"
    )
    engine.add_request("other", prompt(2, 6), GREEDY, adapter="b16")
    engine.add_request("base", prompt(3, 6), GREEDY)
    finished_at = {}
    step = 0
    while len(finished_at) < 3:
        step += 1
        for out in engine.step():
            assert out.error is None
            if out.finished:
                finished_at[out.request_id] = step
        other = engine.reader.live.get("other")
        if "long" not in finished_at and other is not None:
            assert other.status is RequestStatus.WAITING  # b16 waits for a8's slot
    assert finished_at["base"] < finished_at["long"] < finished_at["other"]


def test_reading_an_adapter_never_holds_a_step_back(make_lora_engine, monkeypatch):
    engine = make_lora_engine(max_loras=2)
    release = threading.Event()
    read = engine.lora._read

    def slow_read(handle):
        release.wait(30)
        return read(handle)

    monkeypatch.setattr(engine.lora.loader, "_read", slow_read)
    engine.add_request("adapted", prompt(5, 6), GREEDY, adapter="c64")
    engine.add_request("base", prompt(6, 6), GREEDY)
    done = set()
    for _ in range(GREEDY.max_tokens + 2):  # the base job runs to its end while c64 is being read
        done |= {o.request_id for o in engine.step() if o.finished}
    assert done == {"base"}
    assert engine.reader.live["adapted"].status is RequestStatus.WAITING
    release.set()
    while "adapted" not in done:
        done |= {o.request_id for o in engine.step() if o.finished}


def test_an_adapter_the_loader_refuses_ends_its_jobs_and_nothing_else(
    make_lora_engine, adapters, base_config, tmp_path
):
    broken = write_random_adapter(tmp_path / "nan", base_config, rank=8, seed=9)
    tensors = load_file(broken / WEIGHTS_FILE)
    next(iter(tensors.values()))[0, 0] = float("nan")
    save_file(tensors, broken / WEIGHTS_FILE)
    engine = make_lora_engine(max_loras=2, lora_modules={**adapters, "nan": str(broken)})
    outs = engine.generate([prompt(7, 5)] * 3, GREEDY, adapters=["nan", None, "a8"])
    assert outs[0].finish_reason == "error" and outs[0].error.code == "adapter_error"
    assert "non-finite" in outs[0].error.message and str(broken) in outs[0].error.message
    assert [o.error for o in outs[1:]] == [None, None] and all(len(o.token_ids) == 8 for o in outs[1:])


def test_an_unknown_adapter_is_refused_when_the_request_is_added(make_lora_engine, make_engine):
    with pytest.raises(UnknownAdapter) as e:
        make_lora_engine().add_request("x", [1, 2], GREEDY, adapter="nope")
    assert e.value.code == "model_not_found"
    with pytest.raises(UnknownAdapter):
        make_engine().add_request("x", [1, 2], GREEDY, adapter="a8")  # an engine that serves no adapters


def test_a_padded_decode_graph_step_with_adapter_rows_matches_the_eager_step(make_lora_engine):
    """On CPU the graph runner runs each padded size eagerly: what a captured graph replays, with
    the rows' slots in its static buffers (a step with no adapter rows after one with some too)."""
    engine = make_lora_engine(max_loras=3)
    names = ["a8", None, "c64", "b16", "a8"]
    for i, name in enumerate(names):
        engine.add_request(f"r{i}", prompt(i, 5 + i), SamplingParams(temperature=0, max_tokens=20), adapter=name)
    started = set()
    while len(started) < len(names):
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    inputs = engine.runner.prepare(engine.scheduler.schedule().chunks)
    assert inputs.meta.is_decode and inputs.lora.tokens.shape[0] == 4
    model = engine.runner.model
    max_pages = pages_for(engine.max_model_len, engine.settings.page_size)
    for step in (inputs, replace(inputs, lora=None)):
        caches = [(k.clone(), v.clone()) for k, v in engine.runner.kv_caches]
        graphs = DecodeGraphRunner(
            model, [(k.clone(), v.clone()) for k, v in caches], 8, max_pages, torch.device("cpu")
        )
        padded = graphs.run(step)
        with torch.inference_mode():
            eager = model.compute_logits(model(step.input_ids, step.positions, step.meta, caches, step.lora))
        torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
        assert torch.equal(padded.argmax(-1), eager.argmax(-1))


@pytest.mark.slow
def test_two_tensor_parallel_ranks_with_adapters_generate_what_one_rank_does(checkpoint, adapters):
    """Adapters shard like their base layers; rank 0 tells the other rank what to read and which
    slot to install it in, in step order. Two slots for five adapters: installs evict, on both ranks."""
    names = [None, "a8", "c64", "b16", "e32", "f16", "a8"]
    prompts = [prompt(200 + i, 5 + 2 * i) for i in range(len(names))]
    settings = {
        "num_pages": 256,
        "page_size": 4,
        "max_running": 8,
        "max_num_batched_tokens": 32,
        "max_model_len": 256,
        "lora_modules": adapters,
        "max_loras": 2,
        "max_lora_rank": MAX_RANK,
    }
    single = Engine.from_pretrained(checkpoint, dtype="float32", **settings)
    expected = [o.token_ids for o in single.generate(prompts, GREEDY, adapters=names)]
    with Engine.from_pretrained(checkpoint, dtype="float32", tensor_parallel_size=2, **settings) as tp:
        assert [o.token_ids for o in tp.generate(prompts, GREEDY, adapters=names)] == expected
        assert tp.lora.slots.installs > 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the Triton kernels in decode graphs")
def test_on_cuda_adapter_rows_in_the_decode_graphs_generate_what_the_cpu_engine_does(checkpoint, adapters):
    names = [None, "a8", "c64", "b16", "a8", "e32", "f16"]
    prompts = [prompt(300 + i, 4 + 3 * i) for i in range(len(names))]
    settings = {
        "num_pages": 256,
        "page_size": 4,
        "max_running": 8,
        "max_num_batched_tokens": 64,
        "lora_modules": adapters,
        "max_loras": 4,
        "max_lora_rank": MAX_RANK,
    }
    expected = Engine.from_pretrained(checkpoint, dtype="float32", **settings).generate(prompts, GREEDY, adapters=names)
    gpu = Engine.from_pretrained(checkpoint, device="cuda", dtype="float32", **settings)
    assert gpu.runner.decode_graphs is not None
    gpu.warm_up()
    got = gpu.generate(prompts, GREEDY, adapters=names)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_lora_dir_adapters_are_read_when_first_named_and_one_for_another_base_fails_its_jobs(
    make_lora_engine, base_config, peft_greedy, adapters, tmp_path
):
    from pathlib import Path

    shutil.copytree(Path(adapters["a8"]), tmp_path / "good")
    write_random_adapter(tmp_path / "wide", {**base_config, "hidden_size": 96}, rank=8, seed=3)
    engine = make_lora_engine(lora_modules={}, lora_dir=str(tmp_path), max_loras=2)
    assert engine.adapters() == (["good", "wide"], [])
    p = prompt(8, 6)
    outs = engine.generate([p, p, p], GREEDY, adapters=["good", "wide", None])
    assert outs[0].token_ids == peft_greedy(p, "a8") and outs[2].error is None
    assert outs[1].error.code == "adapter_error"
    assert outs[1].error.message.startswith(f"{tmp_path / 'wide' / WEIGHTS_FILE}: tensor base_model.model.")
    assert engine.adapters() == (["good", "wide"], ["good"])
    with pytest.raises(UnknownAdapter):
        engine.add_request("x", p, GREEDY, adapter="../good")  # one directory below lora_dir, by its name only
