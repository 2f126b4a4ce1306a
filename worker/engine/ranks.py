"""A tensor-parallel engine's other ranks, as rank 0 (the worker's own process) holds them.

`load_shares` builds rank 0's share and the group of the others. `RankGroup.start` checks that
the checkpoint loads, that the model splits over N ranks and that N devices are there, before
any process starts (a refusal is one error, not one per rank); starts ranks 1..N-1 as child
processes (worker/engine/follower.py); meets them once all have started, to join one process
group; and watches them from then on. They meet again once each has loaded its share.

Until the first served step (`start_serving`) every rank's collectives, and the ring, wait for a
peer up to tensor_parallel_startup_timeout_s: in load and warm-up one rank legitimately works
alone for long (rank 0 loads the tokenizer; the first steps compile kernels, each rank at its own
pace) while the others wait. From that step on they wait tensor_parallel_timeout_s, the bound on a hang.

A rank that exits while the group serves is a failure of the whole worker: the watching thread
logs it and sets `failed` at once, and the engine's next call raises RankFailed (the worker's
loop makes one every iteration). The other ranks die with this process (follower.py). `close`
stops them: a STOP message through the ring, then a kill for any still running after a grace.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from dataclasses import replace
from multiprocessing import connection
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from producer_client.errors import InvalidArgument
from worker.engine.follower import follower_main
from worker.engine.rank_setup import resolve_max_model_len
from worker.engine.rendezvous import RankSpec, connect_store, join_process_group, meet, rank_devices
from worker.engine.settings import EngineSettings
from worker.engine.step_ring import StepRing, ring_capacity
from worker.model.config import Qwen3Config
from worker.model.loader import LoadedModel, check_checkpoint, load_model
from worker.model.parallel import TensorParallel, check_shapes
from worker.model.rank_failed import RankFailed

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0
EXIT_NOTICE_S = 1.0


def load_shares(
    path: Path,
    dtype: str | torch.dtype | None,
    device: str | torch.device,
    settings: EngineSettings,
) -> tuple[LoadedModel, RankGroup | None]:
    """Rank 0's share of the model (the whole model for one rank), and the group of the other
    ranks, each with its share loaded."""
    if settings.tensor_parallel_size == 1:
        return load_model(path, dtype, device), None
    ranks = RankGroup.start(path, dtype, device, settings)
    try:
        loaded = load_model(path, dtype, ranks.devices[0], ranks.tp)
        ranks.meet("loaded")
    except BaseException:
        ranks.close()
        raise
    return loaded, ranks


def check_group(config: Qwen3Config, device: str | torch.device, size: int) -> list[torch.device]:
    """The ranks' devices, once what refuses a group of `size` ranks and is known from config.json
    and this machine alone is ruled out: a model that does not split over them, devices that are
    not there, a group this process runs already. Engine.from_pretrained checks it first, before a
    preset is written or a weight read."""
    check_shapes(config, size)
    devices = rank_devices(device, size)
    if dist.is_initialized():
        raise InvalidArgument("tensor_parallel_size", "this process already runs a tensor-parallel engine")
    return devices


class RankGroup:
    def __init__(
        self,
        devices: list[torch.device],
        store: dist.TCPStore,
        ring: StepRing,
        processes: list,
        threads: int,
        timeout_s: float,
    ):
        self.devices = devices
        self.store = store
        self.ring = ring
        self.processes = processes  # rank r's process at index r - 1
        self.tp: TensorParallel | None = None
        self.timeout_s = timeout_s  # a collective's bound from the first served step
        self.starting = True
        self.failed = threading.Event()
        self.failure = ""
        self._closing = False
        self._threads_before = threads
        threading.Thread(target=self._watch, name="mili-tp-watch", daemon=True).start()
        # Before multiprocessing's own exit handler, which joins every child: the ranks wait for
        # their next step until told to stop.
        atexit.register(self.close)

    @classmethod
    def start(
        cls,
        path: Path,
        dtype: str | torch.dtype | None,
        device: str | torch.device,
        settings: EngineSettings,
    ) -> RankGroup:
        """Ranks 1..N-1 started and in one process group with this process, rank 0. The caller
        (on the thread it keeps: children die with the thread that started them) loads rank 0's
        share, meets them at 'loaded', and closes the group on any failure."""
        size = settings.tensor_parallel_size
        devices = check_group(Qwen3Config.from_file(path / "config.json"), device, size)
        config = check_checkpoint(path, dtype)
        store = connect_store(0, 0, size)
        capacity = ring_capacity(settings, resolve_max_model_len(settings, config))
        ring = StepRing(size - 1, capacity, settings.tensor_parallel_startup_timeout_s)
        threads = torch.get_num_threads()
        spec = RankSpec(
            0,
            tuple(map(str, devices)),
            store.port,
            path,
            dtype,
            settings,
            os.getpid(),
            max(1, threads // size) if devices[0].type == "cpu" else threads,
            logging.getLogger().getEffectiveLevel(),
        )
        ctx = mp.get_context("spawn")
        processes = [
            ctx.Process(
                target=follower_main,
                args=(replace(spec, rank=r), ring.reader(r - 1)),
                name=f"mili-tp-rank{r}",
                daemon=True,
            )
            for r in range(1, size)
        ]
        for process in processes:
            process.start()
        group = cls(devices, store, ring, processes, threads, settings.tensor_parallel_timeout_s)
        try:
            torch.set_num_threads(spec.threads)
            meet(store, "started", 0, size, group.check)
            group.tp = join_process_group(store, 0, devices, settings.tensor_parallel_startup_timeout_s)
        except BaseException:
            group.close()
            raise
        pids = [os.getpid(), *(p.pid for p in processes)]
        log.info(
            "tensor parallelism: %d ranks on %s (%s)",
            size,
            ", ".join(spec.devices),
            ", ".join(f"rank {rank}: pid {pid}" for rank, pid in enumerate(pids)),
        )
        return group

    def start_serving(self) -> None:
        """Ends start-up on every rank, before the first served step: the others are told through
        the ring, ahead of that step."""
        if not self.starting:
            return
        self.ring.serve(self.timeout_s)
        self.tp.set_timeout(self.timeout_s)
        self.starting = False

    def meet(self, stage: str) -> None:
        meet(self.store, stage, 0, len(self.devices), self.check)

    def check(self) -> None:
        if self.failed.is_set():
            raise RankFailed(self.failure)

    def explain(self, error: RankFailed) -> RankFailed:
        """A collective failed: when a rank exited (gloo sees its connection close at once, the
        watching thread its exit a moment later), that exit is the better account of it. The group
        counts as failed from here on, so `close` waits for no rank."""
        if self.failed.wait(EXIT_NOTICE_S):
            return RankFailed(self.failure)
        self.failure = error.message
        self.failed.set()
        return error

    def close(self) -> None:
        """Stops the other ranks: asked through the ring while the group serves, killed when it
        failed or never finished starting (and when one does not stop within STOP_GRACE_S)."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        serving = self.tp is not None and not self.failed.is_set()
        if serving:
            try:
                self.ring.stop(STOP_GRACE_S)
            except RankFailed:  # a rank that reads no more: killed below
                serving = False
        for process in self.processes:
            process.join(STOP_GRACE_S if serving else 0)
            if process.is_alive():
                process.kill()
                process.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._threads_before)

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.processes, start=1)}
        ended = connection.wait(list(sentinels))
        if self._closing:
            return
        rank, process = sentinels[ended[0]]
        process.join()
        self.failure = f"tensor-parallel rank {rank} (pid {process.pid}) {describe_exit(process.exitcode)}"
        log.error("%s: the tensor-parallel engine stops", self.failure)
        self.failed.set()


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
