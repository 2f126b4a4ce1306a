"""Ranks 1..N-1 of a tensor-parallel engine. Each runs in a process of its own, started by rank 0
(worker/engine/ranks.py): it builds its share as rank 0 builds its own (load, agree on the KV
pool's size, capture the decode graphs), then runs each step rank 0 sends through the ring,
until told to stop. Its collectives wait tensor_parallel_startup_timeout_s for a peer until rank 0
says start-up is over (worker/engine/ranks.py), tensor_parallel_timeout_s after.

It dies with rank 0: the kernel kills it when the thread that started it ends
(PR_SET_PDEATHSIG), so a worker killed with -9 leaves no rank behind. Signals are rank 0's to
act on: a Ctrl-C or a SIGTERM sent to a terminal's process group reaches every rank, and rank 0
alone decides when the group stops (after its drain). A collective that fails here (rank 0
died, or hangs past the timeout) ends this process; rank 0 notices a rank's exit at once.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import NoReturn

import torch
import torch.distributed as dist

from worker.engine.lora.follower import LoraFollower
from worker.engine.rank_setup import prepare_rank, resolve_max_model_len
from worker.engine.rendezvous import RankSpec, connect_store, join_process_group, meet
from worker.engine.runner import ModelRunner
from worker.engine.step_ring import Kind, Message, RingReader
from worker.model.loader import load_model
from worker.model.lora import warm_up_lora
from worker.model.rank_failed import RankFailed

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def follower_main(spec: RankSpec, reader: RingReader) -> None:
    die_with_parent(spec.parent_pid)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [rank {spec.rank} of {spec.parent_pid}] %(name)s: %(message)s",
    )
    torch.set_num_threads(spec.threads)
    try:
        runner, lora = start_rank(spec)
        serve_steps(reader, runner, spec.settings.tensor_parallel_timeout_s, lora)
    except RankFailed as e:
        log.error("%s: this rank stops", e.message)
        exit_failed()
    except Exception:
        log.exception("tensor-parallel rank %d failed", spec.rank)
        exit_failed()
    dist.destroy_process_group()


def exit_failed() -> NoReturn:
    """Exit code 1 without the interpreter's teardown: a process group whose collective failed
    may abort in its destructor (gloo: "terminate called without an active exception", SIGABRT),
    and rank 0 reports how a rank ended. The log is flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def start_rank(spec: RankSpec) -> tuple[ModelRunner, LoraFollower | None]:
    """This rank's share, ready to run steps: the same start-up as rank 0's, in the same order
    (the adapters' slots before the KV pool is sized)."""
    store = connect_store(spec.store_port, spec.rank, spec.size)
    meet(store, "started", spec.rank, spec.size, lambda: None)
    tp = join_process_group(
        store, spec.rank, [torch.device(d) for d in spec.devices], spec.settings.tensor_parallel_startup_timeout_s
    )
    loaded = load_model(spec.model_path, spec.dtype, spec.device, tp)
    meet(store, "loaded", spec.rank, spec.size, lambda: None)
    settings = spec.settings
    max_model_len = resolve_max_model_len(settings, loaded.config)
    lora = LoraFollower(loaded.model, settings) if settings.serves_lora else None
    memory = prepare_rank(loaded.model, loaded.config, settings, spec.device, max_model_len)
    loaded.model.warm_up_experts(settings.max_num_batched_tokens)
    warm_up_lora(loaded.model, settings.max_num_batched_tokens)
    runner = ModelRunner(
        loaded.model,
        memory.kv_caches,
        settings.page_size,
        spec.device,
        decode_graphs=memory.decode_graphs,
        verify_graphs=memory.verify_graphs,
    )
    return runner, lora


def serve_steps(reader: RingReader, runner: ModelRunner, timeout_s: float, lora: LoraFollower | None = None) -> None:
    """Runs each step rank 0 sends until it sends STOP; from its SERVE on, a collective waits at
    most timeout_s for a peer. Adapter messages go to `lora`: rank 0 sends them only when it
    serves adapters."""
    while (message := reader.receive()).kind is not Kind.STOP:
        if message.kind is Kind.SERVE:
            runner.model.tp.set_timeout(timeout_s)
        elif message.kind is Kind.STEP:
            run_step(runner, message)
        else:
            lora.take(message)


def run_step(runner: ModelRunner, message: Message) -> None:
    """A step that raises here raised on rank 0 too (the same code over the same inputs, up to the
    same point): rank 0 sets its jobs apart and tries them again one by one
    (worker/loop/isolation.py), and this rank runs what it sends next, as one rank would. A failure
    on some ranks only leaves a collective unmatched, which times out."""
    future = None
    if message.future_rows:  # filled by rank 0's broadcast of its previous draws
        future = torch.empty(message.future_rows, dtype=torch.int64, device=runner.device)
    try:
        runner.execute(message.step, future)
    except Exception:
        log.exception("a step failed on this rank")


def die_with_parent(parent_pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent_pid:  # rank 0 died before the line above
        os._exit(1)
