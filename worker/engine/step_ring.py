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
arrays one after another, each at an 8-byte boundary; a step whose rows use LoRA adapters
carries its LoraRows after them. An adapter message (READ: start reading it; INSTALL: put it in
a slot) carries the slot and the adapter's name and path as JSON, and comes before the step
that first uses the slot, as rank 0 decided (worker/engine/lora/follower.py).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.multiprocessing as mp

from worker.engine.host_step import HostStep
from worker.engine.kv_pool import pages_for
from worker.engine.lora.rows import LoraRows
from worker.model.rank_failed import RankFailed

if TYPE_CHECKING:
    from worker.engine.settings import EngineSettings

SLOTS = 2  # overlapped, rank 0 writes step N+1 while the others may still be reading step N
HEADER = 10  # int64 words


class Kind(enum.IntEnum):
    STEP = 1
    STOP = 2
    SERVE = 3  # start-up is over: the next step is the first served one
    ADAPTER_READ = 4
    ADAPTER_INSTALL = 5


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


LORA_ARRAYS = (("tokens", np.int64), ("group_ends", np.int32))  # LoraRows'
MAX_ADAPTER_MESSAGE = 8192  # bytes of an adapter message's JSON (its name and path)


def message_bytes(tokens: int, rows: int, width: int, lora_slots: int = 0) -> int:
    """The largest message a step of up to `tokens` tokens over up to `rows` sequences, page
    tables up to `width` wide, rows on `lora_slots` adapter slots, can take: what a slot must hold.
    Every token may sample (a step that verifies drafted tokens samples at each)."""
    sizes = lengths(tokens, rows, width, tokens)
    step = sum(aligned(sizes[name] * np.dtype(dtype).itemsize) for name, dtype in ARRAYS)
    if not lora_slots:
        return 8 * HEADER + step
    lora = aligned(8 * tokens) + aligned(4 * lora_slots)
    return 8 * HEADER + max(step + lora, MAX_ADAPTER_MESSAGE)


def ring_capacity(settings: EngineSettings, max_model_len: int) -> int:
    """The slot size the engine's largest step needs. A verify step laid out for its CUDA graphs
    (worker/engine/verify_graphs.py) gives every running request k + 1 tokens, padding included,
    whatever the step's token budget, and its page table reaches k + 1 positions past a sequence."""
    q = settings.num_speculative_tokens + 1 if settings.speculative_method is not None else 1
    tokens = max(settings.max_num_batched_tokens, settings.max_running * q)
    width = pages_for(max_model_len - 1 + q, settings.page_size)  # a sequence's last position, then q - 1 more
    lora_slots = settings.max_loras if settings.serves_lora else 0
    return message_bytes(tokens, settings.max_running, width, lora_slots)


def aligned(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


@dataclass
class Message:
    kind: Kind
    step: HostStep | None = None
    future_rows: int = 0  # the previous step's draws, which this step's placeholders stand for
    adapter: AdapterMessage | None = None


@dataclass(frozen=True)
class AdapterMessage:
    """Read the adapter `name` at `path`, or install it in `slot`."""

    slot: int
    name: str
    path: str


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

    def send_adapter(self, kind: Kind, adapter: AdapterMessage) -> None:
        self._write(Message(kind, adapter=adapter), self.timeout_s)

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
    if message.adapter is not None:
        pack_adapter(message.adapter, header, slot)
    step = message.step
    if step is None:
        return
    header[2:7] = (step.max_q_len, *step.page_table.shape, step.input_ids.size, step.sample_indices.size)
    offset = 8 * HEADER
    for name, dtype in ARRAYS:
        offset = pack_array(slot, offset, getattr(step, name), dtype, name)
    if step.lora is not None:
        header[7:9] = (step.lora.tokens.size + 1, step.lora.group_ends.size)
        for name, dtype in LORA_ARRAYS:
            offset = pack_array(slot, offset, getattr(step.lora, name), dtype, name)


def pack_array(slot: np.ndarray, offset: int, values: np.ndarray, dtype, name: str) -> int:
    """Writes `values` at `offset`; returns where the next array goes."""
    array = np.ascontiguousarray(values, dtype=dtype).reshape(-1)
    if offset + array.nbytes > slot.shape[0]:
        raise ValueError(f"a step's {name} overflows the ring's {slot.shape[0]}-byte slot")
    slot[offset : offset + array.nbytes] = array.view(np.uint8)
    return offset + aligned(array.nbytes)


def pack_adapter(adapter: AdapterMessage, header: np.ndarray, slot: np.ndarray) -> None:
    data = json.dumps({"name": adapter.name, "path": adapter.path}).encode()
    if len(data) > MAX_ADAPTER_MESSAGE:
        raise ValueError(f"adapter {adapter.name}'s path is over {MAX_ADAPTER_MESSAGE} bytes")
    header[1:3] = (adapter.slot, len(data))
    slot[8 * HEADER : 8 * HEADER + len(data)] = np.frombuffer(data, dtype=np.uint8)


def unpack(slot: np.ndarray) -> Message:
    """A copy of the slot's message: the slot is written again once every reader is done with it."""
    header = slot[: 8 * HEADER].view(np.int64).copy()
    kind = Kind(int(header[0]))
    if kind in (Kind.ADAPTER_READ, Kind.ADAPTER_INSTALL):
        fields = json.loads(bytes(slot[8 * HEADER : 8 * HEADER + int(header[2])]))
        return Message(kind, adapter=AdapterMessage(int(header[1]), fields["name"], fields["path"]))
    if kind is not Kind.STEP:
        return Message(kind)
    max_q_len, rows, width, tokens, samples = (int(v) for v in header[2:7])
    sizes = lengths(tokens, rows, width, samples)
    arrays, offset = {}, 8 * HEADER
    for name, dtype in ARRAYS:
        arrays[name], offset = unpack_array(slot, offset, sizes[name], dtype)
    arrays["page_table"] = arrays["page_table"].reshape(rows, width)
    lora = None
    if header[7]:
        lora_sizes = {"tokens": int(header[7]) - 1, "group_ends": int(header[8])}
        lora_arrays = {}
        for name, dtype in LORA_ARRAYS:
            lora_arrays[name], offset = unpack_array(slot, offset, lora_sizes[name], dtype)
        lora = LoraRows(**lora_arrays)
    return Message(kind, HostStep(**arrays, max_q_len=max_q_len, lora=lora), int(header[1]))


def unpack_array(slot: np.ndarray, offset: int, size: int, dtype) -> tuple[np.ndarray, int]:
    nbytes = size * np.dtype(dtype).itemsize
    return slot[offset : offset + nbytes].view(dtype).copy(), offset + aligned(nbytes)
