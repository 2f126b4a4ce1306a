"""One long request through the engine, with the model's KV cache and with the float8 one, beside
transformers on the same checkpoint and prompt, in the same run.

    python -m bench.long_context                                         # CUDA: qwen3-0.6b, 32,768-token prompt
    python -m bench.long_context --model tiny --prompt-tokens 2048 --max-tokens 32   # the CPU rehearsal

Per run it prints the prefill time (the prompt, chunked by max_num_batched_tokens, to its first
token), the decode rate of the tokens after it, and the engine's memory for the request as a
multiple of the request's KV bytes: the KV pool, sized to the request, and the peak of what the
request's steps allocate beyond it (CUDA: allocated device memory; CPU: resident memory, whose
high-water mark Linux resets on request). transformers runs the prompt's forward (prefill) and `generate` (greedy, its own
KV cache) on the same prompt; the ratios are against it.
"""

import argparse
import sys
import time
from dataclasses import dataclass

import torch
from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM

from harness.peak_memory import peak_memory
from producer_client.schema import SamplingParams
from worker.engine import Engine, EngineSettings
from worker.engine.kv_pool import pages_for
from worker.model.config import Qwen3Config
from worker.model.loader import load_model, resolve_dtype
from worker.model.presets import resolve_model_path
from worker.model.tokenizer import Tokenizer

PAGE_SIZE = 16


@dataclass
class Run:
    name: str
    prefill_s: float
    decode_tokens_per_s: float
    peak_bytes: int | None = None
    kv_bytes: int | None = None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engine(args, prompt: list[int], kv_cache_dtype: str, device: torch.device) -> Run:
    """The engine's memory for the request: its KV pool (sized to it), and the peak of what its
    steps allocate beyond it; what warm-up loads once per process (compiled kernels) is not counted."""
    path = resolve_model_path(args.model)
    loaded = load_model(path, args.dtype, device)
    settings = EngineSettings.parse(
        kv_cache_dtype=kv_cache_dtype,
        num_pages=pages_for(len(prompt) + args.max_tokens + PAGE_SIZE, PAGE_SIZE),
        page_size=PAGE_SIZE,
        max_running=1,
        max_model_len=len(prompt) + args.max_tokens + 1,
    )
    engine = Engine(loaded.model, loaded.config, Tokenizer.from_dir(path), settings, [], device)
    engine.warm_up()
    memory = {}
    with peak_memory(device, memory):
        engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
        start, first, produced = time.perf_counter(), None, 0
        while engine.has_unfinished():
            produced += sum(len(out.new_token_ids) for out in engine.step())
            if first is None and produced:
                first = time.perf_counter()
        end = time.perf_counter()
    kv = engine.runner.kv_caches
    token_bytes = 2 * len(kv) * kv[0][0][0, 0].numel() * kv[0][0].element_size()
    pool_bytes = engine.allocator.num_pages * settings.page_size * token_bytes  # allocated before the request
    del engine, loaded
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Run(
        f"engine, KV cache {kv_cache_dtype}",
        first - start,
        (produced - 1) / (end - first),
        pool_bytes + memory["bytes"],
        (len(prompt) + args.max_tokens - 1) * token_bytes,
    )


@torch.inference_mode()
def run_transformers(args, prompt: list[int], device: torch.device) -> Run:
    path = resolve_model_path(args.model)
    dtype = resolve_dtype(args.dtype, Qwen3Config.from_file(path / "config.json"))
    model = HFQwen3ForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ids = torch.tensor([prompt], device=device)
    synchronize(device)
    start = time.perf_counter()
    model(ids, logits_to_keep=1)
    synchronize(device)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=args.max_tokens,
        min_new_tokens=args.max_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    synchronize(device)
    total = time.perf_counter() - start
    return Run("transformers (generate, greedy)", prefill, (args.max_tokens - 1) / max(total - prefill, 1e-9))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="qwen3-0.6b on CUDA, tiny on CPU, unless given")
    parser.add_argument("--dtype", default=None, help="the checkpoint's own unless given")
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--max-tokens", type=int, default=512)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.model = args.model or ("qwen3-0.6b" if device.type == "cuda" else "tiny")
    prompt = torch.randint(0, 10000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    runs = [run_engine(args, prompt, kv, device) for kv in ("auto", "fp8_e4m3")]
    hf = run_transformers(args, prompt, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"\n{args.model} on {name}: a {args.prompt_tokens:,}-token prompt, {args.max_tokens} tokens generated, "
        f"torch {torch.__version__}\n"
    )
    print(
        "| run | prefill s | prefill speed-up over transformers | decode tok/s | decode speed-up | "
        "memory for the request | its KV | multiple |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for run in runs + [hf]:
        memory = "-" if run.peak_bytes is None else f"{run.peak_bytes / 2**20:,.0f} MiB"
        kv = "-" if run.kv_bytes is None else f"{run.kv_bytes / 2**20:,.0f} MiB"
        multiple = "-" if run.kv_bytes is None else f"{run.peak_bytes / run.kv_bytes:.2f}x"
        print(
            f"| {run.name} | {run.prefill_s:.2f} | {hf.prefill_s / run.prefill_s:.2f}x | "
            f"{run.decode_tokens_per_s:,.1f} | {run.decode_tokens_per_s / hf.decode_tokens_per_s:.2f}x | "
            f"{memory} | {kv} | {multiple} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
