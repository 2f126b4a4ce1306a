"""Tensor parallelism's costs, each beside its baseline in the same run (ranks on the CPU joined by
gloo; with --device cuda the head and step parts run on 2 GPUs over NCCL):

  broadcast  each step's inputs sent from rank 0 to another rank: the shared-memory ring the
             engine uses (worker/engine/step_ring.py) against broadcasting the same message over
             the process group (a header, then the payload), for a decode step of 64 requests, a
             4096-token prefill, and 256 requests with page tables 512 pages wide. CPU time per
             message on each side, and wall time per message in a stream of them.
  head       the LM head's logits over 2 ranks: each rank's half of the vocabulary, gathered on
             rank 0 (what the model does), against rank 0 computing them all alone (a head
             replicated on rank 0), at Qwen3's vocabulary.
  load       each rank's peak resident memory while loading a checkpoint from safetensors (its
             VmHWM, reset just before): one rank and each of two, beside safetensors' own
             memory-mapped reader loading the whole model (the loader before tensor parallelism).
  step       engine decode steps with one rank and with two: on CPU a sanity figure (the two
             ranks share the cores and gloo's latency, so two ranks are slower).

    python -m bench.tp                        # all four, CPU, the small preset
    python -m bench.tp --parts head step --device cuda --model qwen3-0.6b --batch 64    # 2 GPUs
    python -m bench.tp --parts broadcast head step --model tiny --messages 50 --hidden-size 64 \
        --steps 3 --batch 4                       # the CPU rehearsal of the GPU acceptance's tp stage
"""

from __future__ import annotations

import argparse
import datetime
import re
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.measure import cpu_seconds
from producer_client.schema import SamplingParams
from worker.engine.host_step import HostStep
from worker.engine.step_ring import HEADER, Kind, Message, StepRing, aligned, message_bytes, pack, unpack
from worker.model.presets import resolve_model_path

PARTS = ("broadcast", "head", "load", "step")
MESSAGES = {  # name -> (tokens, rows, page table width)
    "decode, 64 requests": (64, 64, 64),
    "prefill, 4096 tokens": (4096, 8, 64),
    "decode, 256 requests x 512 pages": (256, 256, 512),
}


def main() -> None:
    args = parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, parts: {', '.join(args.parts)}")
    for part in args.parts:
        {"broadcast": bench_broadcast, "head": bench_head, "load": bench_load, "step": bench_step}[part](args)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--model", default="small", help="preset or checkpoint directory (load, step)")
    parser.add_argument("--messages", type=int, default=2000, help="messages per kind (broadcast)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed (step)")
    parser.add_argument("--batch", type=int, default=8, help="requests decoding at once (step)")
    parser.add_argument(
        "--hidden-size",
        type=int,
        default=None,
        help="the LM head's hidden size (head; default 1024 on the CPU, 5120, Qwen3-14B's, on CUDA)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the head and step parts run")
    return parser.parse_args()


def spawn(target, size: int, *args) -> list:
    """Runs target(rank, size, port, queue, *args) in `size` fresh processes; their results, by rank."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, size + 1, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, size, store.port, results, *args)) for rank in range(size)]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return [out[rank] for rank in range(size)]


def join_group(rank: int, size: int, port: int, device: str = "cpu") -> torch.device:
    """This process in the group (gloo, or NCCL on GPU `rank`); its device."""
    store = dist.TCPStore("127.0.0.1", port, size + 1, is_master=False)
    here = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(here)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(minutes=5),
        device_id=here if device == "cuda" else None,
    )
    return here


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- broadcast -----------------------------------------------------------------------------


def random_step(tokens: int, rows: int, width: int) -> HostStep:
    rng = np.random.default_rng(tokens)
    return HostStep(
        rng.integers(0, 151936, tokens),
        rng.integers(0, 4096, tokens),
        rng.integers(0, 2**20, tokens),
        rng.integers(0, 2**16, (rows, width)).astype(np.int32),
        np.full(rows, 1000, np.int32),
        np.full(rows, 999, np.int32),
        np.arange(rows + 1, dtype=np.int32),
        np.arange(rows),
        1,
    )


def broadcast_over_group(rank: int, step: HostStep | None, buffer: np.ndarray) -> Message:
    """The alternative: the same message over the process group, its size first."""
    header = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        pack(Message(Kind.STEP, step), buffer)
        header[0] = 8 * HEADER + sum(aligned(a.nbytes) for a in vars(step).values() if isinstance(a, np.ndarray))
    dist.broadcast(header, 0)
    payload = torch.from_numpy(buffer[: int(header[0])])
    dist.broadcast(payload, 0)
    return unpack(buffer) if rank else Message(Kind.STEP, step)


def broadcast_worker(rank, size, port, results, ring_end, count) -> None:
    torch.set_num_threads(1)
    join_group(rank, size, port)
    figures = {}
    for name, shape in MESSAGES.items():
        step = random_step(*shape)
        buffer = np.zeros(message_bytes(*shape), dtype=np.uint8)
        for transport in ("ring", "group"):
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(count):
                if transport == "group":
                    broadcast_over_group(rank, step, buffer)
                elif rank == 0:
                    ring_end.send(step)
                else:
                    ring_end.receive()
            dist.barrier()
            figures[name, transport] = ((time.perf_counter() - wall) / count, (time.process_time() - cpu) / count)
    results.put((rank, figures))
    dist.destroy_process_group()


def bench_broadcast(args) -> None:
    capacity = max(message_bytes(*shape) for shape in MESSAGES.values())
    ring = StepRing(readers=1, capacity=capacity, timeout_s=600)
    figures = spawn_with_ends(ring, args.messages)
    print(f"\nstep inputs, rank 0 -> rank 1 ({args.messages} messages each; microseconds per message)")
    print(
        f"{'message':36s} {'bytes':>9s} | {'ring: wall':>10s} {'cpu r0':>7s} {'cpu r1':>7s} | "
        f"{'group: wall':>11s} {'cpu r0':>7s} {'cpu r1':>7s} | {'group/ring cpu':>14s}"
    )
    for name, shape in MESSAGES.items():
        ring_f = [figures[r][name, "ring"] for r in (0, 1)]
        group_f = [figures[r][name, "group"] for r in (0, 1)]
        ratio = sum(g[1] for g in group_f) / sum(r[1] for r in ring_f)
        print(
            f"{name:36s} {message_bytes(*shape):9d} | {ring_f[0][0] * 1e6:10.1f} {ring_f[0][1] * 1e6:7.1f} "
            f"{ring_f[1][1] * 1e6:7.1f} | {group_f[0][0] * 1e6:11.1f} {group_f[0][1] * 1e6:7.1f} "
            f"{group_f[1][1] * 1e6:7.1f} | {ratio:14.1f}x"
        )


def spawn_with_ends(ring: StepRing, count: int) -> list:
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    ends = [ring, ring.reader(0)]
    procs = [ctx.Process(target=broadcast_worker, args=(r, 2, store.port, results, ends[r], count)) for r in (0, 1)]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return [out[0], out[1]]


# -- the LM head ---------------------------------------------------------------------------


def head_worker(rank, size, port, results, hidden_size, vocab, rows_list, repeats, device) -> None:
    from worker.model.parallel import TensorParallel
    from worker.model.qwen3 import project_logits

    torch.set_num_threads(1)
    here = join_group(rank, size, port, device)
    tp = TensorParallel(rank, size, dist.group.WORLD, here)
    dtype = torch.bfloat16 if here.type == "cuda" else torch.float32
    head = torch.randn(vocab, hidden_size, device=here).to(dtype)
    share = head[tp.vocab(vocab).start : tp.vocab(vocab).stop].contiguous()
    figures = {}
    for rows in rows_list:
        hidden = torch.randn(rows, hidden_size, device=here).to(dtype)
        out = torch.empty(rows, vocab, device=here)
        for mode in ("split", "rank 0 alone"):
            dist.barrier()
            synchronize(here)
            wall = time.perf_counter()
            for _ in range(repeats):
                if mode == "split":
                    tp.gather_vocab(project_logits(hidden, share), vocab, out if rank == 0 else None)
                else:
                    if rank == 0:
                        project_logits(hidden, head, out)
                    dist.barrier()  # rank 1 waits, as it would for the next step
            synchronize(here)
            figures[rows, mode] = (time.perf_counter() - wall) / repeats
    results.put((rank, figures))
    dist.destroy_process_group()


def bench_head(args) -> None:
    cuda = args.device == "cuda"
    hidden_size, rows_list = (5120, (1, 64, 256)) if cuda else (1024, (1, 8, 64))
    hidden_size, vocab = args.hidden_size or hidden_size, 151936
    figures = spawn(head_worker, 2, hidden_size, vocab, rows_list, 200 if cuda else 20, args.device)[0]
    print(
        f"\nLM head over 2 ranks, hidden {hidden_size}, vocabulary {vocab}, "
        f"{'bfloat16 on 2 GPUs' if cuda else 'float32'} (ms per step, rank 0's wall)"
    )
    print(f"{'rows':>5s} {'split + gather':>15s} {'rank 0 alone':>13s} {'split/alone':>12s}")
    for rows in rows_list:
        split, alone = figures[rows, "split"], figures[rows, "rank 0 alone"]
        print(f"{rows:5d} {split * 1e3:15.2f} {alone * 1e3:13.2f} {split / alone:11.2f}x")


# -- loading -------------------------------------------------------------------------------


def status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def load_worker(rank, size, port, results, path, how) -> None:
    from worker.model.loader import load_model
    from worker.model.parallel import TensorParallel

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status_kib("VmRSS")
    if how == "mmap":
        model = load_with_mmap(path)
    else:
        model = load_model(path, tp=TensorParallel(rank, size)).model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    results.put((rank, ((status_kib("VmHWM") - before) * 1024, weights)))


def load_with_mmap(path: str):
    """The loader before tensor parallelism: safetensors' reader maps the file and each tensor is
    copied out of the mapping into the model."""
    from safetensors import safe_open

    from worker.model.loader import checkpoint_targets, read_configs, tensor_files
    from worker.model.qwen3 import Qwen3ForCausalLM

    _, config, _ = read_configs(path)
    _, files = tensor_files(Path(path))
    model = Qwen3ForCausalLM(config, config.dtype)
    for name, target in checkpoint_targets(model).items():
        with safe_open(files[name], framework="pt") as f:
            target.dest.copy_(f.get_tensor(name))
    return model


def bench_load(args) -> None:
    path = str(resolve_model_path(args.model))
    print(f"\npeak resident memory a load adds, {args.model} (MiB; VmHWM reset before the load)")
    print(f"{'loader':44s} {'weights':>9s} {'peak':>9s} {'peak/whole mmap':>16s}")
    mmap_peak, mmap_weights = spawn(load_worker, 1, path, "mmap")[0]
    rows = [("safetensors' mmap reader, whole model (baseline)", mmap_peak, mmap_weights)]
    rows.append(("pread, whole model (1 rank)", *spawn(load_worker, 1, path, "pread")[0]))
    for rank, (peak, weights) in enumerate(spawn(load_worker, 2, path, "pread")):
        rows.append((f"pread, rank {rank} of 2", peak, weights))
    for name, peak, weights in rows:
        print(f"{name:44s} {weights / 2**20:9.1f} {peak / 2**20:9.1f} {peak / mmap_peak:15.2f}x")


# -- engine steps --------------------------------------------------------------------------


def bench_step(args) -> None:
    from worker.engine import Engine

    threads = torch.get_num_threads()
    print(f"\ndecode steps of {args.batch} requests, {args.model}, one rank vs two on {args.device} (ms per step)")
    if args.device == "cuda":
        configs = {"1 rank, 1 GPU": (1, threads), "2 ranks, 2 GPUs": (2, threads)}
    else:  # two ranks share this process's threads (one each of two); one rank runs with as many, and with one
        configs = {
            f"1 rank, {threads} threads": (1, threads),
            "1 rank, 1 thread": (1, 1),
            f"2 ranks, {max(1, threads // 2)} thread each": (2, threads),
        }
    figures = {}
    for name, (size, config_threads) in configs.items():
        torch.set_num_threads(config_threads)
        with Engine.from_pretrained(
            args.model,
            device=args.device,
            kv_cache_mib=256,
            max_model_len=1024,
            max_running=max(args.batch, 8),
            tensor_parallel_size=size,
        ) as engine:
            engine.warm_up()
            figures[name] = time_decode(engine, args)
    torch.set_num_threads(threads)
    base_name = next(name for name in configs if name.startswith("1 rank, 1 "))
    print(f"{'':28s} {'wall':>8s} {'cpu, all ranks':>15s} {'wall / ' + base_name:>24s}")
    base = figures[base_name][0]
    for name, (wall, cpu) in figures.items():
        print(f"{name:28s} {wall * 1e3:8.2f} {cpu * 1e3:15.2f} {wall / base:23.2f}x")


def time_decode(engine, args) -> tuple[float, float]:
    params = SamplingParams(temperature=0, max_tokens=args.steps + 5, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [(i * 31 + t) % 1000 + 100 for t in range(32)], params)
    engine.step()  # the prefill
    engine.step()
    pids = [p.pid for p in engine.ranks.processes] if engine.ranks is not None else []
    wall, cpu = time.perf_counter(), time.process_time() + sum(cpu_seconds(pid) for pid in pids)
    for _ in range(args.steps):
        engine.step()
    cpu = time.process_time() + sum(cpu_seconds(pid) for pid in pids) - cpu
    wall = time.perf_counter() - wall
    while engine.has_unfinished():
        engine.step()
    return wall / args.steps, cpu / args.steps


if __name__ == "__main__":
    main()
