"""Engine.warm_up: it runs at every page size, leaves the engine generating what a cold one does,
and compiles every Triton kernel variant that serving can launch."""

import contextlib
import importlib
import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from triton.backends.compiler import BaseBackend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

from producer_client.schema import SamplingParams
from tests.engine.test_engine import random_prompts, token_ids
from worker.engine import Engine, EngineSettings
from worker.engine.lora.adapters import AdapterHandle
from worker.engine.lora.rows import LoraRows
from worker.engine.lora.slots import DeviceSlots
from worker.model.loader import load_model
from worker.model.lora import attach_lora, warm_up_lora
from worker.model.lora_adapter import read_adapter
from worker.model.random_adapter import write_random_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.mark.parametrize("page_size", [1, 2])
def test_an_engine_with_tiny_pages_warms_up_and_generates_what_page_size_16_does(make_engine, page_size):
    prompts = random_prompts(5, 1, 40, seed=21)
    expected = token_ids(make_engine(page_size=16).generate(prompts, GREEDY))
    engine = make_engine(page_size=page_size, num_pages=2048 // page_size)
    engine.warm_up()
    assert engine.allocator.num_free == engine.allocator.num_pages
    assert token_ids(engine.generate(prompts, GREEDY)) == expected


# -- every Triton kernel variant the engine can launch is compiled by warm-up ---------------------

# By import_module: kernels/__init__ rebinds `kernels.rms_norm` to the function of that name.
KERNEL_MODULES = tuple(
    importlib.import_module(f"kernels.{name}")
    for name in (
        "activation",
        "decode_attention",
        "extend_attention",
        "fused_moe",
        "kv_store",
        "lora_expand",
        "lora_shrink",
        "moe_align",
        "rms_norm",
        "rope",
    )
)
decode_attention = importlib.import_module("kernels.decode_attention")


@contextlib.contextmanager
def recorded_launches(monkeypatch: pytest.MonkeyPatch):
    """Stands in for the launched kernels (`_*_kernel`) of kernels/ while the block runs: each
    launch goes through, and its specialization key, as Triton computes it to pick (or compile)
    a variant, is recorded.

    The key is what Triton's binder makes of a launch: each argument's type, a pointer's 16-byte
    alignment, an integer's being 1 or a multiple of 16 (unless the kernel opts out for it), the
    constexpr values, and the launch options."""
    launches = Launches(set(), {})
    with monkeypatch.context() as patch:
        for module in KERNEL_MODULES:
            for name, kernel in vars(module).items():
                if name.endswith("_kernel") and isinstance(kernel, (JITFunction, InterpretedFunction)):
                    patch.setattr(module, name, RecordingKernel(name, kernel, launches))
        yield launches


@dataclass
class Launches:
    keys: set[tuple]
    values: dict[tuple[str, str], set]  # (kernel, argument) -> the integers it was launched with


class RecordingKernel:
    def __init__(self, name: str, kernel, launches: Launches):
        self.name, self.kernel, self.launches = name, kernel, launches
        jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
        self.bind = create_function_from_signature(jit.signature, jit.params, BaseBackend)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            bound, specialization, options = self.bind(*args, **kwargs)
            self.launches.keys.add((self.name, tuple(map(repr, specialization)), tuple(sorted(options.items()))))
            for arg, value in bound.items():
                if isinstance(value, int):
                    self.launches.values.setdefault((self.name, arg), set()).add(value)
            return self.kernel[grid](*args, **kwargs)

        return launch


def varied_num_splits():
    """Stands in for the GPU's choice of decode splits (it follows the batch and the context):
    counts of 1, of a multiple of 16 and of neither come up in turn."""
    counts = itertools.cycle([1, 7, 16, 32, 3])
    return lambda batch, kv_heads, max_context, device: next(counts)


def serve_a_varied_batch(engine) -> None:
    """Page tables 1 page wide, of a multiple of 16 pages and of neither (at page size 4), a
    prefix-cache hit, chunked prefills beside decodes, greedy and seeded top-p rows."""
    engine.generate([[1], [2, 3]], SamplingParams(temperature=0, max_tokens=2))  # page tables 1 page wide
    shared = random_prompts(1, 20, 20, seed=22)[0]
    prompts = random_prompts(1, 62, 62, seed=23) + random_prompts(1, 33, 33, seed=24)
    prompts += [shared + [1], shared + [2, 3]]  # a prefix-cache hit
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (6, 3, 2, 2)]
    params[1] = SamplingParams(temperature=0.9, top_p=0.8, seed=1, max_tokens=3)
    engine.generate(prompts, params)  # chunked prefills beside decodes, page tables up to 18 pages


# tests/conftest.py imports the kernels in interpreter mode only where there is no GPU.
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, the test below counts the compiles themselves")
@pytest.mark.slow
def test_warm_up_compiles_every_kernel_variant_a_varied_batch_launches(make_engine, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors take the Triton path, interpreted
    monkeypatch.setattr(decode_attention, "decode_num_splits", varied_num_splits())
    engine = make_engine(max_num_batched_tokens=48, max_running=8)  # page size 4

    with recorded_launches(monkeypatch) as warm_up:
        engine.warm_up()
    with recorded_launches(monkeypatch) as serving:
        serve_a_varied_batch(engine)

    assert {name for name, _, _ in serving.keys} == {
        "_rms_norm_kernel",
        "_head_norm_rope_kernel",
        "_silu_and_mul_kernel",
        "_store_kv_kernel",
        "_extend_kernel",
        "_decode_split_kernel",
        "_decode_merge_kernel",
    }
    for kernel in ("_decode_split_kernel", "_extend_kernel"):  # widths of 1, of a multiple of 16, of neither
        widths = serving.values[(kernel, "page_table_stride")]
        assert 1 in widths and any(w % 16 == 0 for w in widths) and any(w > 1 and w % 16 for w in widths), widths
    assert {1, 7, 16} <= serving.values[("_decode_merge_kernel", "num_splits")]
    assert serving.keys <= warm_up.keys, sorted(serving.keys - warm_up.keys)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts the compiles of kernels built for a CUDA device")
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_on_cuda_no_triton_kernel_compiles_after_warm_up(checkpoint, loaded, monkeypatch, cuda_graphs):
    """What the interpreter test above infers from specialization keys, counted on the GPU: Triton
    calls knobs.runtime.jit_cache_hook before it compiles (or loads from its disk cache) a variant
    that is not in memory yet. Eager decodes launch every decode kernel themselves; with graphs
    only prefills do, as in serving. The split count follows the batch and the contexts there."""
    from triton import knobs

    _, tokenizer = loaded
    model, config, _ = load_model(checkpoint, dtype=torch.bfloat16, device="cuda")
    settings = EngineSettings.parse(
        page_size=4, num_pages=256, max_num_batched_tokens=48, max_running=8, cuda_graphs=cuda_graphs
    )
    engine = Engine(model, config, tokenizer, settings, [], torch.device("cuda"))
    engine.warm_up()
    compiled = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kwargs: compiled.append(kwargs["repr"]))
    serve_a_varied_batch(engine)
    assert compiled == []


@pytest.mark.cuda
def test_moe_warm_up_compiles_every_kernel_variant_steps_of_any_size_launch(moe_checkpoint, monkeypatch):
    # 6 experts, 3 per token: steps of more than 64 tokens take 32-pair blocks, of more than 256, 64.
    if torch.cuda.is_available():
        device = "cuda"
    else:
        device = "cpu"
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors take the Triton path, interpreted
    model, config, _ = load_model(moe_checkpoint, dtype=torch.float32, device=device)
    with recorded_launches(monkeypatch) as warm_up:
        model.warm_up_experts(300)
    with recorded_launches(monkeypatch) as serving, torch.inference_mode():
        g = torch.Generator().manual_seed(0)
        for layer, tokens in zip(itertools.cycle([0, 2]), (1, 2, 3, 17, 64, 65, 100, 256, 257, 300)):
            model.model.layers[layer].mlp(torch.randn(tokens, config.hidden_size, generator=g).to(device))

    assert {name for name, _, _ in serving.keys} == {"_align_kernel", "_gate_up_kernel", "_down_kernel"}
    assert serving.values[("_gate_up_kernel", "BLOCK_M")] == {16, 32, 64}
    assert serving.keys <= warm_up.keys, sorted(serving.keys - warm_up.keys)


@pytest.mark.cuda
def test_lora_warm_up_compiles_every_kernel_variant_steps_of_any_size_launch(checkpoint, tmp_path, monkeypatch):
    # 2 slots: steps of more than 64 adapter rows take 32-row blocks, of more than 256, 64.
    if torch.cuda.is_available():
        device = "cuda"
    else:
        device = "cpu"
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    model, config, _ = load_model(checkpoint, dtype=torch.float32, device=device)
    targets = attach_lora(model, 2, 16)
    slots = DeviceSlots(targets, 2)
    for slot, rank in enumerate((8, 16)):
        path = write_random_adapter(tmp_path / str(rank), config, rank, seed=rank)
        slots.install(slot, AdapterHandle(str(rank), path), read_adapter(str(rank), path, targets, 16, torch.float32))
    with recorded_launches(monkeypatch) as warm_up:
        warm_up_lora(model, 300)
    with recorded_launches(monkeypatch) as serving, torch.inference_mode():
        for rows, layer in zip((1, 5, 64, 65, 200, 257, 300), itertools.cycle([0, 1])):
            low = -1 if rows % 2 else 0  # odd counts have base rows among them
            batch = LoraRows.of(np.random.default_rng(rows).integers(low, 2, rows), np.ones(rows, dtype=np.int64), 2)
            x = torch.randn(rows, config.hidden_size, device=device)
            model.model.layers[layer].self_attn.qkv_proj(x, batch.to_device(torch.device(device)))
            model.model.layers[layer].mlp.down_proj(torch.cat([x, x], 1), batch.to_device(torch.device(device)))

    lora = {key for key in serving.keys if key[0].startswith("_lora_")}
    assert {name for name, _, _ in lora} == {"_lora_shrink_kernel", "_lora_expand_kernel"}
    assert serving.values[("_lora_shrink_kernel", "BLOCK_M")] == {16, 32, 64}
    assert lora <= warm_up.keys, sorted(lora - warm_up.keys)


def test_engine_warm_up_runs_the_moe_experts_up_to_the_step_budget(make_moe_engine, monkeypatch):
    engine = make_moe_engine(max_num_batched_tokens=300, max_running=4)
    budgets = []
    monkeypatch.setattr(engine.runner.model, "warm_up_experts", budgets.append)
    engine.warm_up()
    assert budgets == [300]
