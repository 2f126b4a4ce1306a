"""Every running request's KV pages as one row of a persistent table, for the model runner.

A step's page table is one gather of its requests' rows. Building it from the requests' page
lists instead costs a Python-level copy of every page id of every request, every step; here
a row is written when its request first runs, and afterwards only where it gained a page.
That holds because the scheduler never changes a page list in place except to append to it:
it gives a request a new list when it (re)starts, and releases the row when it takes the
pages back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from worker.engine.request import Request

INITIAL_ROWS, INITIAL_COLUMNS = 64, 64  # both grow by doubling, to what the running requests need


@dataclass
class _Row:
    index: int
    pages: list[int]  # the page list the row mirrors
    written: int  # how many of its pages the row holds


class PageTable:
    def __init__(self):
        self._table = np.zeros((INITIAL_ROWS, INITIAL_COLUMNS), dtype=np.int32)
        self._rows: dict[Request, _Row] = {}
        self._free = list(range(INITIAL_ROWS - 1, -1, -1))

    def rows_for(self, requests: Iterable[Request]) -> list[int]:
        """Each request's row index, its row brought up to date with its pages."""
        indexes = []
        for req in requests:
            row = self._rows.get(req)
            if row is None or row.pages is not req.pages or row.written != len(req.pages):
                row = self._write(req, row)
            indexes.append(row.index)
        return indexes

    def gather(self, rows: list[int], width: int) -> np.ndarray:
        """[len(rows), width] int32: the first `width` page ids of each row (zeros past a row's pages)."""
        return self._table[rows, :width]

    def release(self, req: Request) -> None:
        """Frees the request's row (zeroed); a request that runs again gets a row anew."""
        row = self._rows.pop(req, None)
        if row is not None:
            self._table[row.index, : row.written] = 0
            self._free.append(row.index)

    def _write(self, req: Request, row: _Row | None) -> _Row:
        if row is None:
            row = _Row(self._take_free_row(), req.pages, 0)
            self._rows[req] = row
        elif row.pages is not req.pages:  # a new list: rewritten whole
            self._table[row.index, : row.written] = 0
            row.pages, row.written = req.pages, 0
        pages = req.pages
        self._fit_columns(len(pages))
        self._table[row.index, row.written : len(pages)] = pages[row.written :]
        row.written = len(pages)
        return row

    def _take_free_row(self) -> int:
        if not self._free:
            rows, columns = self._table.shape
            self._table = np.concatenate([self._table, np.zeros((rows, columns), dtype=np.int32)])
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()

    def _fit_columns(self, num_pages: int) -> None:
        rows, columns = self._table.shape
        if num_pages > columns:
            wider = np.zeros((rows, max(num_pages, 2 * columns)), dtype=np.int32)
            wider[:, :columns] = self._table
            self._table = wider
