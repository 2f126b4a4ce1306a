"""Compiling constraints into matchers, once per grammar and off the step loop.

One thread compiles. The loop hands it a constraint and goes on; the request waits unadmitted
until its matcher is ready, and the requests behind it are admitted meanwhile. llguidance's view
of the vocabulary (Tokenizer.grammar_tables: about a second of CPU for Qwen3's 151,936 tokens) is
built on that thread, once: when `prepare` asks for it (Engine.warm_up does, before the engine
serves: the build holds the GIL, and so every other thread, for up to 0.9 s), else at the first
structured request.

Compiled grammars are kept by the hash of their grammar in an LRU of at most `cache_size`: a
prototype matcher each, of which every request gets its own copy (a copy costs microseconds,
a compile milliseconds to seconds). One thread, not a pool: compiles are rare next to hits, and
a second thread would take a core from the model on a CPU host.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import llguidance

from producer_client.errors import InvalidArgument
from worker.engine.grammar.constraint import Constraint
from worker.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class CompilerStats:
    cache_hits: int = 0
    compiles: int = 0  # cache misses that compiled, failures included
    compile_seconds: float = 0.0


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, drawable: int, eos_token_ids: list[int], cache_size: int):
        """`vocab_size`: the mask's, at least the tokenizer's vocabulary (masks.py); `drawable`: the
        model's, whose tokens alone spell the text a grammar forces."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.drawable = drawable
        self.eos_token_ids = eos_token_ids
        self.cache_size = cache_size
        self.stats = CompilerStats()
        self._cache: OrderedDict[str, Any] = OrderedDict()  # key -> prototype LLMatcher; the thread's alone
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()

    def prepare(self) -> Future:
        """Builds the vocabulary's tables on the compile thread, ahead of the first constraint."""
        return self._thread().submit(self._tokenizer_info)

    def submit(self, constraint: Constraint, then: Callable[[Any], T]) -> Future[T]:
        """A future of `then(matcher)`, run on the compile thread with a fresh matcher of the
        constraint. It raises InvalidArgument (naming the constraint's field) when the grammar
        does not compile."""
        return self._thread().submit(lambda: then(self._matcher(constraint)))

    def shutdown(self) -> None:
        """Stops the compile thread; a compile waiting for it is cancelled."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _thread(self) -> ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compiler")
            return self._executor

    def _matcher(self, constraint: Constraint):
        prototype = self._cache.get(constraint.key)
        if prototype is not None:
            self._cache.move_to_end(constraint.key)
            self.stats.cache_hits += 1
        else:
            prototype = self._compile(constraint)
        return prototype.deep_copy()

    def _compile(self, constraint: Constraint):
        info = self._tokenizer_info()
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(info, constraint.grammar, log_level=0)
        seconds = time.perf_counter() - start
        self.stats.compiles += 1
        self.stats.compile_seconds += seconds
        if matcher.is_error():
            raise InvalidArgument(constraint.field, f"the grammar library refuses it: {matcher.get_error()}")
        log.debug("compiled grammar %s in %.1f ms", constraint.key[:12], seconds * 1000)
        self._cache[constraint.key] = matcher
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return matcher

    def _tokenizer_info(self):
        return self.tokenizer.grammar_tables(self.vocab_size, self.drawable, self.eos_token_ids)
