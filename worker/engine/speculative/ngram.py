"""Prompt and output n-gram lookup (vLLM's and SGLang's `ngram`, "prompt lookup decoding"): the
draft is what followed the latest earlier occurrence of the request's last n tokens, the longest
n from MAX_N down to MIN_N that occurs. It costs no model, and pays where output repeats its
context: code edited in place, a summary quoting its input, a structured answer echoing keys.

Each request keeps an index from every n-gram of its tokens to where it last ended, extended by
the tokens added since the previous lookup, so a lookup costs a few dictionary reads however long
the context (a scan of the context per step would cost a step of batch 256 milliseconds).
"""

from __future__ import annotations

import weakref

from worker.engine.request import Request
from worker.engine.scheduler import ScheduledChunk

MAX_N = 4
MIN_N = 2  # a single repeated token predicts the next one too rarely to be worth verifying


class NgramIndex:
    """For each n, each n-gram of a token list -> the position of the token that last followed it."""

    def __init__(self):
        self.follows: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(MIN_N, MAX_N + 1)}
        self.indexed = 0  # positions [0, indexed) have had their preceding n-grams recorded

    def update(self, tokens: list[int]) -> None:
        for position in range(max(self.indexed, MIN_N), len(tokens)):
            for n, follows in self.follows.items():
                if position >= n:
                    follows[tuple(tokens[position - n : position])] = position
        self.indexed = len(tokens)

    def lookup(self, tokens: list[int], limit: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest indexed suffix of `tokens`."""
        for n in range(MAX_N, MIN_N - 1, -1):
            if len(tokens) <= n:
                continue
            position = self.follows[n].get(tuple(tokens[-n:]))
            if position is not None:
                return tokens[position : position + limit]
        return []


class NgramProposer:
    def __init__(self):
        self._indexes: weakref.WeakKeyDictionary[Request, NgramIndex] = weakref.WeakKeyDictionary()

    def observe(self, chunks: list[ScheduledChunk]) -> None:
        pass  # it drafts from the requests' tokens alone

    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        drafts = []
        for req, limit in zip(requests, limits):
            index = self._indexes.get(req)
            if index is None:
                index = self._indexes[req] = NgramIndex()
            index.update(req.token_ids)
            drafts.append(index.lookup(req.token_ids, limit))
        return drafts
