"""Reads of rectangles of rows and columns of a safetensors file's tensors, straight into the
model's parameters, with no mapping of the file.

A tensor-parallel rank needs a share of most tensors: whole rows of column-parallel weights,
some columns of every row of row-parallel ones. Mapping the file (as safetensors' own reader
does) makes every page a read touches count in the process's RSS, and a share of columns
touches nearly every page of its tensor. Reading with pread leaves those pages in the kernel's
page cache, outside the process: a rank's memory is its share of the model, plus one block of
at most BLOCK_BYTES while it picks columns out of rows (or converts a dtype).

The format, from github.com/huggingface/safetensors (README, "Format"): an unsigned
little-endian 64-bit header size N, N bytes of a JSON object mapping each tensor's name to its
`dtype`, `shape` and `data_offsets` [begin, end) relative to the byte buffer that follows the
header (and an optional string map `__metadata__`); tensors are little-endian and row-major.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from worker.model.config import CheckpointError

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
ELEMENT_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}
MAX_HEADER_BYTES = 100 * 2**20  # the format's own limit
BLOCK_BYTES = 64 * 2**20


class TensorEntry(NamedTuple):
    dtype: str  # the file's name for it: F32, BF16, ...
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_elements(self) -> int:
        return math.prod(self.shape[1:])


class SafetensorsFile:
    """An open safetensors file: its tensors' entries, and `read` of any rows and columns of one."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot open ({e.strerror})") from None
        try:
            self.tensors = self._read_header()
        except BaseException:
            os.close(self._fd)
            raise

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        os.close(self._fd)

    def read(self, name: str, dest: torch.Tensor, rows: range, cols: range | None = None) -> None:
        """Rows `rows` (and of each only the columns `cols`, for a 2-D tensor) of tensor `name`
        into `dest`, a contiguous tensor of that shape on any device, converted to its dtype."""
        entry, dtype = self.tensors[name], self.torch_dtype(name)
        row_bytes = entry.row_elements * dtype.itemsize
        whole_rows = cols is None or len(cols) == entry.row_elements
        if whole_rows and dest.dtype == dtype and dest.device.type == "cpu" and dest.is_contiguous():
            self._read_bytes(entry.offset + rows.start * row_bytes, byte_view(dest))
            return
        step = max(1, BLOCK_BYTES // max(row_bytes, 1))
        for start in range(rows.start, rows.stop, step):
            stop = min(start + step, rows.stop)
            block = torch.empty((stop - start, *entry.shape[1:]), dtype=dtype)
            self._read_bytes(entry.offset + start * row_bytes, byte_view(block))
            part = block if whole_rows else block[:, cols.start : cols.stop]
            dest[start - rows.start : stop - rows.start].copy_(part)

    def torch_dtype(self, name: str) -> torch.dtype:
        """Tensor `name`'s dtype; CheckpointError for one this reader does not take."""
        stored = self.tensors[name].dtype
        if stored not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name} has dtype {stored}, not one of {', '.join(DTYPES)}")
        return DTYPES[stored]

    def _read_bytes(self, offset: int, out: np.ndarray) -> None:
        view = memoryview(out)
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                raise CheckpointError(f"{self.path}: ends inside the tensor data at byte {offset + done}")
            done += n

    def _read_header(self) -> dict[str, TensorEntry]:
        size = os.fstat(self._fd).st_size
        if size < 8:
            raise self._unreadable("shorter than its 8-byte header size")
        header_bytes = int.from_bytes(os.pread(self._fd, 8, 0), "little")
        if header_bytes > min(MAX_HEADER_BYTES, size - 8):
            raise self._unreadable(f"header size {header_bytes} exceeds the file or the format's limit")
        try:
            header = json.loads(os.pread(self._fd, header_bytes, 8))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise self._unreadable(f"header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise self._unreadable("header is not a JSON object")
        data_start = 8 + header_bytes
        header.pop("__metadata__", None)
        return {name: self._entry(name, raw, data_start, size - data_start) for name, raw in header.items()}

    def _entry(self, name: str, raw, data_start: int, data_bytes: int) -> TensorEntry:
        try:
            dtype, shape, (begin, end) = raw["dtype"], tuple(raw["shape"]), raw["data_offsets"]
            valid = (
                isinstance(dtype, str)
                and all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(begin, int)
                and isinstance(end, int)
                and 0 <= begin <= end <= data_bytes
            )
        except (TypeError, KeyError, ValueError):
            valid = False
        if not valid:
            raise self._unreadable(f"bad header entry for tensor {name}: {raw!r}")
        expected = math.prod(shape) * ELEMENT_BYTES.get(dtype, 0)
        if dtype in ELEMENT_BYTES and end - begin != expected:
            raise self._unreadable(f"tensor {name} has {end - begin} bytes, its shape {list(shape)} needs {expected}")
        return TensorEntry(dtype, shape, data_start + begin)

    def _unreadable(self, reason: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a readable safetensors file ({reason})")


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor, writable, as numpy sees them (any dtype, bfloat16 too)."""
    return t.reshape(-1).view(torch.uint8).numpy()
