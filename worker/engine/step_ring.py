"""How rank 0 of a tensor-parallel group hands each step's inputs to the other ranks: a ring of
slots in shared memory, as vLLM's shared-memory broadcast does, with a semaphore per reader
for "a message is ready" and one for "I am done with a slot".

bench/tp.py measured it against broadcasting the same arrays over the process group (gloo)
and chose it (bench/RESULTS.md): a step's message is a memcpy and two semaphore operations
per reader, where a gloo broadcast costs a round trip through its transport threads per
tensor. Waiting readers sleep in sem_wait, so idle ranks cost no CPU, and a reader waits for
the next step as long as rank 0 has no work: that is no hang, so it has no timeout (a reader
whose rank 0 died is killed with it, worker/engine/follower.py). Rank 0 waits for a free slot
at most `timeout_s`: only a rank that stopped reading (it hangs) makes it wait that long. That is
the start-up timeout until `serve` tells the readers that start-up is over (a SERVE message),
and the served steps' timeout after.

A message is a header of int64 (the kind, the arrays' lengths, the step's longest chunk and
the rows of draws a step of the overlap scheduler receives by broadcast) and the HostStep's
arrays one after another, each at an 8-byte boundary.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch
import torch.multiprocessing as mp

from worker.engine.host_step import HostStep
from worker.model.rank_failed import RankFailed

SLOTS = 2  # overlapped, rank 0 writes step N+1 while the others may still be reading step N
HEADER = 8  # int64 words


class Kind(enum.IntEnum):
    STEP = 1
    STOP = 2
    SERVE = 3  # start-up is over: the next step is the first served one


ARRAYS = (  # HostStep's arrays, in the order of a message
    ("input_ids", np.int64),
    ("positions", np.int64),
    ("slot_mapping", np.int64),
    ("page_table", np.int32),
    ("seq_lens", np.int32),
    ("prefix_lens", np.int32),
    ("cu_seqlens_q", np.int32),
    ("sample_indices", np.int64),
)


def lengths(tokens: int, rows: int, width: int, samples: int) -> dict[str, int]:
    """Each array's length in a step of `tokens` tokens over `rows` sequences, page tables `width`
    wide, `samples` of them sampling."""
    return {
        "input_ids": tokens,
        "positions": tokens,
        "slot_mapping": tokens,
        "page_table": rows * width,
        "seq_lens": rows,
        "prefix_lens": rows,
        "cu_seqlens_q": rows + 1,
        "sample_indices": samples,
    }


def message_bytes(tokens: int, rows: int, width: int) -> int:
    """The largest message a step of up to `tokens` tokens over up to `rows` sequences, page
    tables up to `width` wide, can take: what a slot must hold. Every token may sample (a step
    that verifies drafted tokens samples at each)."""
    sizes = lengths(tokens, rows, width, tokens)
    return 8 * HEADER + sum(aligned(sizes[name] * np.dtype(dtype).itemsize) for name, dtype in ARRAYS)


def aligned(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


@dataclass
class Message:
    kind: Kind
    step: HostStep | None = None
    future_rows: int = 0  # the previous step's draws, which this step's placeholders stand for


class StepRing:
    """Rank 0's end: `send` writes a message every reader then reads once, in order."""

    def __init__(self, readers: int, capacity: int, timeout_s: float):
        ctx = mp.get_context("spawn")
        self.slots = torch.zeros(SLOTS, capacity, dtype=torch.uint8).share_memory_()
        self.ready = [ctx.Semaphore(0) for _ in range(readers)]
        self.free = [ctx.Semaphore(SLOTS) for _ in range(readers)]
        self.timeout_s = timeout_s
        self.sent = 0

    def reader(self, index: int) -> RingReader:
        """What reader `index` (rank index + 1) takes to its process."""
        return RingReader(self.slots, self.ready[index], self.free[index])

    def send(self, step: HostStep, future_rows: int = 0) -> None:
        self._write(Message(Kind.STEP, step, future_rows), self.timeout_s)

    def serve(self, timeout_s: float) -> None:
        """Tells the readers that start-up is over; waits at most timeout_s from here on."""
        self._write(Message(Kind.SERVE), self.timeout_s)
        self.timeout_s = timeout_s

    def stop(self, timeout_s: float) -> None:
        self._write(Message(Kind.STOP), timeout_s)

    def _write(self, message: Message, timeout_s: float) -> None:
        for reader, free in enumerate(self.free, start=1):
            if not free.acquire(timeout=timeout_s):
                raise RankFailed(f"tensor-parallel rank {reader} has read no step for {timeout_s:g} s: it hangs")
        pack(message, self.slots[self.sent % SLOTS].numpy())
        for ready in self.ready:
            ready.release()
        self.sent += 1


class RingReader:
    """A rank's end: `receive` blocks until the next message."""

    def __init__(self, slots: torch.Tensor, ready, free):
        self.slots = slots
        self.ready = ready
        self.free = free
        self.received = 0

    def receive(self) -> Message:
        self.ready.acquire()
        try:
            return unpack(self.slots[self.received % SLOTS].numpy())
        finally:
            self.free.release()
            self.received += 1


def pack(message: Message, slot: np.ndarray) -> None:
    header = slot[: 8 * HEADER].view(np.int64)
    header[:] = 0
    header[0], header[1] = message.kind, message.future_rows
    step = message.step
    if step is None:
        return
    header[2:7] = (step.max_q_len, *step.page_table.shape, step.input_ids.size, step.sample_indices.size)
    offset = 8 * HEADER
    for name, dtype in ARRAYS:
        array = np.ascontiguousarray(getattr(step, name), dtype=dtype).reshape(-1)
        if offset + array.nbytes > slot.shape[0]:
            raise ValueError(f"a step's {name} overflows the ring's {slot.shape[0]}-byte slot")
        slot[offset : offset + array.nbytes] = array.view(np.uint8)
        offset += aligned(array.nbytes)


def unpack(slot: np.ndarray) -> Message:
    """A copy of the slot's message: the slot is written again once every reader is done with it."""
    header = slot[: 8 * HEADER].view(np.int64).copy()
    kind = Kind(int(header[0]))
    if kind is not Kind.STEP:
        return Message(kind)
    max_q_len, rows, width, tokens, samples = (int(v) for v in header[2:7])
    sizes = lengths(tokens, rows, width, samples)
    arrays, offset = {}, 8 * HEADER
    for name, dtype in ARRAYS:
        nbytes = sizes[name] * np.dtype(dtype).itemsize
        arrays[name] = slot[offset : offset + nbytes].view(dtype).copy()
        offset += aligned(nbytes)
    arrays["page_table"] = arrays["page_table"].reshape(rows, width)
    return Message(kind, HostStep(**arrays, max_q_len=max_q_len), int(header[1]))
