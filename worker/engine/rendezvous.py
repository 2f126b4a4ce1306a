"""How the ranks of a tensor-parallel engine find each other and form their process group; the
same steps on rank 0 (worker/engine/ranks.py) and on the others (worker/engine/follower.py).

They meet through a TCP store that rank 0 serves on localhost (the ranks of one worker share a
host). A meeting is polled rather than waited on with a timeout, so rank 0 can notice a rank
that died meanwhile and no rank gives up on a slow one: loading a large share from a slow disk
takes as long as it takes, and is no hang.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from producer_client.errors import InvalidArgument
from worker.engine.settings import EngineSettings
from worker.model.parallel import TensorParallel

STORE_HOST = "127.0.0.1"
STORE_CONNECT_TIMEOUT = datetime.timedelta(minutes=5)
POLL_S = 0.05


@dataclass(frozen=True)
class RankSpec:
    """What rank `rank` needs to build its share and join the group (sent to its process)."""

    rank: int
    devices: tuple[str, ...]  # every rank's, rank 0's first
    store_port: int
    model_path: Path
    dtype: str | torch.dtype | None
    settings: EngineSettings
    parent_pid: int
    threads: int  # torch's CPU threads for each rank
    log_level: int

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def device(self) -> torch.device:
        return torch.device(self.devices[self.rank])


def rank_devices(device: str | torch.device, size: int) -> list[torch.device]:
    """One device per rank: cuda:K..K+N-1 from `device` cuda:K (or cuda, K=0), or the CPU for
    every rank. InvalidArgument when there are not that many (GPUs visible, CPU cores)."""
    device = torch.device(device)
    if device.type == "cpu":
        cores = os.cpu_count() or 1
        if size > cores:
            raise InvalidArgument(
                "tensor_parallel_size",
                f"{size} ranks on the CPU need as many cores, {cores} are there",
            )
        return [device] * size
    if device.type != "cuda":
        raise InvalidArgument("tensor_parallel_size", f"ranks run on cuda or cpu devices, not {device.type}")
    first, visible = device.index or 0, torch.cuda.device_count()
    if first + size > visible:
        raise InvalidArgument(
            "tensor_parallel_size",
            f"{size} ranks need GPUs cuda:{first}..cuda:{first + size - 1}, {visible} are visible",
        )
    return [torch.device("cuda", first + r) for r in range(size)]


def connect_store(port: int, rank: int, size: int) -> dist.TCPStore:
    """Rank 0 serves the store (port 0: any free port) and the others connect to it."""
    return dist.TCPStore(
        STORE_HOST,
        port,
        size,
        is_master=rank == 0,
        timeout=STORE_CONNECT_TIMEOUT,
        wait_for_workers=False,
    )


def meet(store: dist.TCPStore, stage: str, rank: int, size: int, check: Callable[[], None]) -> None:
    """Returns once every rank has reached `stage`; `check` runs while waiting (rank 0 raises
    there when another rank died)."""
    store.set(f"{stage}/{rank}", "1")
    others = [f"{stage}/{r}" for r in range(size) if r != rank]
    while not store.check(others):
        check()
        time.sleep(POLL_S)


def join_process_group(
    store: dist.TCPStore,
    rank: int,
    devices: list[torch.device],
    timeout_s: float,
) -> TensorParallel:
    """The group of every rank (NCCL on GPUs, gloo on CPU), once all have met at 'started': a
    collective then waits at most timeout_s for a peer (the start-up's, until
    TensorParallel.set_timeout)."""
    device = devices[rank]
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("tp", store),
        rank=rank,
        world_size=len(devices),
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return TensorParallel(rank, len(devices), dist.group.WORLD, device)
