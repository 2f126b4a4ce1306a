"""Offline throughput: our Engine against transformers `generate`, same checkpoint, same workload, same run.

    python -m bench.offline                          # issue workload: `small` on CPU, qwen3-0.6b on CUDA
    python -m bench.offline --workload nanovllm      # 256 requests, input and output in [100, 1024]
    python -m bench.offline --num-requests 8 --max-output 32    # a quick smoke run

Workloads are random token ids (fixed seed), greedy, every request generating exactly its
drawn number of tokens (ignore_eos). The transformers baseline runs the fair, strongest
simple way: batched `generate` with left padding, batches in input order, each batch's
max_new_tokens the largest of its requests' outputs (min_new_tokens the same, so no row
stops early on an eos); only the tokens each request asked for count as useful output.
"""

import argparse
import logging
import random
import time
from dataclasses import dataclass

import torch

from producer_client.schema import SamplingParams
from worker.engine import Engine
from worker.model.presets import resolve_model_path

log = logging.getLogger("bench.offline")

PROMPT_ID_LIMIT = 10000  # prompt ids are drawn below this, as in nano-vllm's bench.py

WORKLOADS = {
    # name: (requests, prompt length range, output length range)
    "issue": (64, (32, 512), (32, 256)),
    "nanovllm": (256, (100, 1024), (100, 1024)),
}


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    seconds: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def make_workload(
    num_requests: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    seed: int,
) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(PROMPT_ID_LIMIT) for _ in range(rng.randint(*prompt_range))] for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(num_requests)])


def run_engine(engine: Engine, work: Workload) -> Result:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    start = time.perf_counter()
    outputs = engine.generate(work.prompts, params)
    seconds = time.perf_counter() - start
    produced = [len(o.token_ids) for o in outputs]
    if produced != work.output_lens:
        raise RuntimeError(f"engine produced {sum(produced)} tokens, asked for {work.output_tokens}")
    return Result(seconds, sum(produced))


@torch.inference_mode()
def run_transformers(model, work: Workload, batch_size: int, device: str) -> Result:
    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch_size):
        prompts, lens = work.prompts[i : i + batch_size], work.output_lens[i : i + batch_size]
        ids, mask = left_padded(prompts, device)
        n = max(lens)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        if out.shape[1] != ids.shape[1] + n:
            raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, asked for {n}")
        log.info("transformers: batch %d/%d done", i // batch_size + 1, -(-len(work.prompts) // batch_size))
    if device == "cuda":
        torch.cuda.synchronize()
    return Result(time.perf_counter() - start, work.output_tokens)


def left_padded(prompts: list[list[int]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_and_workload_args(p, default_workload="issue")
    p.add_argument("--hf-batch-size", type=int, default=32, help="transformers batch size (32: its best on CPU)")
    p.add_argument("--skip-hf", action="store_true", help="run our engine only")
    p.add_argument("--threads", type=int, help="torch CPU threads for both engines (default: torch's)")
    p.add_argument("--max-num-batched-tokens", type=int, help="engine setting (default: EngineSettings')")
    p.add_argument("--max-running", type=int, help="engine setting (default: EngineSettings')")
    add_kv_cache_mib(p)
    add_engine_switches(p)
    return p.parse_args()


def add_model_and_workload_args(p: argparse.ArgumentParser, default_workload: str) -> None:
    """The model, device and workload flags that offline.py and serve.py share."""
    cuda = torch.cuda.is_available()
    p.add_argument("--model", default="qwen3-0.6b" if cuda else "small", help="preset name or checkpoint directory")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", default=None, help="default: the checkpoint's (small: float32, qwen3-0.6b: bfloat16)")
    p.add_argument("--workload", choices=list(WORKLOADS), default=default_workload)
    p.add_argument("--num-requests", type=int, help="override the workload's request count")
    p.add_argument("--max-prompt", type=int, help="cap the workload's prompt length range")
    p.add_argument("--max-output", type=int, help="cap the workload's output length range")
    p.add_argument("--seed", type=int, default=0)


def add_engine_switches(p: argparse.ArgumentParser) -> None:
    """On/off engine settings, for ablations (default: EngineSettings', which follow the device)."""
    for name in ("cuda_graphs", "overlap_schedule"):
        p.add_argument(
            "--" + name.replace("_", "-"),
            action=argparse.BooleanOptionalAction,
            default=None,
            help="engine setting (default: EngineSettings')",
        )


def add_kv_cache_mib(p: argparse.ArgumentParser) -> None:
    """The KV pool's size on CPU: a CPU run of a tiny model (the GPU acceptance's rehearsals) sizes it to
    the model, since every engine zeroes its pool at start (0.55 s of CPU a GiB)."""
    p.add_argument("--kv-cache-mib", type=int, help="engine setting, the KV pool on CPU (default: EngineSettings')")


def workload_from(args: argparse.Namespace) -> Workload:
    n, (plo, phi), (olo, ohi) = WORKLOADS[args.workload]
    if args.max_prompt:
        plo, phi = min(plo, args.max_prompt), min(phi, args.max_prompt)
    if args.max_output:
        olo, ohi = min(olo, args.max_output), min(ohi, args.max_output)
    return make_workload(args.num_requests or n, (plo, phi), (olo, ohi), args.seed)


def engine_settings(args: argparse.Namespace) -> dict:
    settings = {
        name: getattr(args, name)
        for name in ("max_num_batched_tokens", "max_running", "kv_cache_mib", "cuda_graphs", "overlap_schedule")
    }
    return {k: v for k, v in settings.items() if v is not None}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = workload_from(args)
    path = resolve_model_path(args.model)
    log.info(
        "%s on %s: %d requests, %d prompt tokens, %d output tokens, %d torch threads",
        args.model,
        args.device,
        len(work.prompts),
        sum(len(p) for p in work.prompts),
        work.output_tokens,
        torch.get_num_threads(),
    )
    warmup = make_workload(2, (16, 16), (4, 4), args.seed + 1)

    engine = Engine.from_pretrained(path, device=args.device, dtype=args.dtype, **engine_settings(args))
    run_engine(engine, warmup)
    ours = run_engine(engine, work)
    stats = engine.stats()
    print(
        f"engine:       {ours.output_tokens} tokens in {ours.seconds:.1f}s = {ours.tokens_per_s:.1f} output tok/s "
        f"({stats.steps} steps, {stats.preemptions} preemptions)"
    )
    del engine
    if args.skip_hf:
        return

    from transformers import Qwen3ForCausalLM  # dev dependency, the baseline only

    model = Qwen3ForCausalLM.from_pretrained(path, dtype=args.dtype or "auto").to(args.device).eval()
    run_transformers(model, warmup, args.hf_batch_size, args.device)
    theirs = run_transformers(model, work, args.hf_batch_size, args.device)
    print(
        f"transformers: {theirs.output_tokens} tokens in {theirs.seconds:.1f}s = {theirs.tokens_per_s:.1f} "
        f"output tok/s (batches of {args.hf_batch_size})"
    )
    print(f"ratio:        {ours.tokens_per_s / theirs.tokens_per_s:.2f}x")


if __name__ == "__main__":
    main()
