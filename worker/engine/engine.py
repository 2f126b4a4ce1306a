"""The engine: requests in, per-step token deltas out.

One step reads top to bottom: the scheduler picks chunks -> the runner extends their KV and
returns logits for the chunks that reach their sequence's end -> the sampler picks tokens
(masked by their requests' grammars, if any: worker.engine.grammar) -> the reader checks each
token against the request's stop conditions and reports it as a delta (reader.py). `generate`,
the engine as a library, is in offline.py.

With tensor_parallel_size N the engine is rank 0 of N (worker/engine/ranks.py): it schedules
and samples alone, and every rank runs each step's forward over its share of the model.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from producer_client.errors import InvalidArgument, UnknownAdapter
from producer_client.schema import SamplingParams
from worker.engine.errors import PromptTooLong
from worker.engine.grammar.compiler import GrammarCompiler
from worker.engine.grammar.constraint import Constraint
from worker.engine.grammar.draft_masks import DraftMasks
from worker.engine.grammar.masks import GrammarMasks
from worker.engine.grammar.request_grammar import RequestGrammar, replayed
from worker.engine.kv_pool import PageAllocator, pages_for
from worker.engine.lora.manager import LoraManager
from worker.model.lora import warm_up_lora
from worker.engine.offline import OfflineGeneration
from worker.engine.overlap import LaunchedStep, launched
from worker.engine.radix_cache import RadixCache
from worker.engine.outputs import Capacity, EngineStats, RequestError, RequestOutput
from worker.engine.rank_setup import prepare_rank, resolve_max_model_len
from worker.engine.ranks import RankGroup, check_group, load_shares
from worker.engine.reader import StepReader
from worker.engine.request import Request
from worker.engine.runner import ModelRunner
from worker.engine.sampler import Sampler
from worker.engine.scheduler import ScheduledChunk, Scheduler
from worker.engine.settings import EngineSettings
from worker.engine.speculative.factory import build_speculator, load_speculative_model, speculative_bytes_per_page
from worker.engine.speculative.verify import sampling_rows
from worker.engine.stop import TextOutput
from kernels.token_bitmask import apply_token_bitmask
from worker.model.config import Qwen3Config
from worker.model.rank_failed import RankFailed
from worker.model.presets import model_config, resolve_model_path
from worker.model.progress import logged_step
from worker.model.qwen3 import Qwen3ForCausalLM
from worker.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# How long a step with nothing to run waits for a grammar being compiled, instead of returning
# at once to a caller that would call again straight away.
COMPILE_WAIT_S = 0.005


class Engine(OfflineGeneration):
    def __init__(
        self,
        model: Qwen3ForCausalLM,
        config: Qwen3Config,
        tokenizer: Tokenizer,
        settings: EngineSettings,
        eos_token_ids: list[int],
        device: torch.device,
        ranks: RankGroup | None = None,
    ):
        self.settings = settings
        self.device = device
        self.ranks = ranks  # the other ranks of a tensor-parallel engine (from_pretrained), stopped by close()
        self.tokenizer = tokenizer
        self.vocab_size = config.vocab_size
        self.max_model_len = resolve_max_model_len(settings, config)
        # Stop tokens the model cannot emit (a small test vocabulary) are dropped, not masked.
        self.eos_token_ids = sorted(t for t in set(eos_token_ids) if t < config.vocab_size)
        # Before the KV pool is sized: the adapters' slots take their memory first.
        ring = ranks.ring if ranks is not None else None
        self.lora = LoraManager.attach(model, settings, device, ring) if settings.serves_lora else None
        draft = load_speculative_model(settings, model, device)
        memory = prepare_rank(
            model, config, settings, device, self.max_model_len, speculative_bytes_per_page(draft, settings, device)
        )
        self.allocator = PageAllocator(memory.num_pages)
        self.cache = RadixCache(self.allocator, settings.page_size, settings.enable_prefix_cache)
        self.scheduler = Scheduler(
            self.allocator,
            self.cache,
            settings.page_size,
            settings.max_running,
            settings.max_num_batched_tokens,
            self.max_model_len,
        )
        self.runner = ModelRunner(
            model,
            memory.kv_caches,
            settings.page_size,
            device,
            self.scheduler.page_table,
            memory.decode_graphs,
            ranks.ring if ranks is not None else None,
            memory.verify_graphs,
        )
        self.sampler = Sampler(self.eos_token_ids)
        self.overlap = overlap_enabled(settings, device)
        self._in_flight: LaunchedStep | None = None  # overlapped: the step the device may still be running
        self.reader = StepReader(self.scheduler, self.eos_token_ids, self.max_model_len, self.vocab_size)
        # A mask covers the tokenizer's vocabulary, whose size the model's may fall short of (test models).
        mask_vocab = max(self.vocab_size, tokenizer.vocab_size)
        self.grammars = GrammarCompiler(
            tokenizer, mask_vocab, self.vocab_size, self.eos_token_ids, settings.grammar_cache_size
        )
        self.masks = GrammarMasks(mask_vocab, self.eos_token_ids, settings.max_running)
        self.draft_masks = DraftMasks(self.masks)
        self.speculator = build_speculator(settings, self.max_model_len, draft, model, self.scheduler, self.draft_masks)
        self._compiling: list[Request] = []  # requests whose grammar has not started yet
        self._ended: list[RequestOutput] = []  # finals of requests that ended between steps (aborts)
        self._arrivals = itertools.count()
        self._generate_ids = itertools.count()
        self._steps = self._computed_tokens = self._computed_prompt_tokens = 0
        self._log_limits(memory.num_pages)

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        **settings,
    ) -> Engine:
        """A preset name ('tiny', 'tiny-moe', 'small', 'qwen3-0.6b') or a checkpoint directory; settings as in EngineSettings.

        With tensor_parallel_size N > 1 the model is split over N ranks: this process is rank 0
        on `device` (cuda:K: ranks take cuda:K..K+N-1), and N-1 processes are started for the
        others, to be stopped with `close()` (or `with Engine.from_pretrained(...) as engine`)."""
        engine_settings = EngineSettings.parse(**settings)
        if engine_settings.tensor_parallel_size > 1:  # a refusal comes before a preset is written or a weight read
            check_group(model_config(model), device, engine_settings.tensor_parallel_size)
        path = resolve_model_path(model)
        with logged_step(log, f"loading {path} on {device}"):
            loaded, ranks = load_shares(path, dtype, device, engine_settings)
            try:
                tokenizer = Tokenizer.from_dir(path)
                eos = list(loaded.generation_config.eos_token_ids) + list(tokenizer.eos_token_ids)
                rank_device = ranks.devices[0] if ranks is not None else torch.device(device)
                return cls(loaded.model, loaded.config, tokenizer, engine_settings, eos, rank_device, ranks)
            except BaseException:
                if ranks is not None:
                    ranks.close()
                raise

    @property
    def devices(self) -> list[str]:
        """The device of every rank, rank 0's first."""
        return [str(d) for d in self.ranks.devices] if self.ranks is not None else [str(self.device)]

    def close(self) -> None:
        """Stops the other ranks of a tensor-parallel engine (nothing to do for one rank)."""
        if self.ranks is not None:
            self.ranks.close()

    def warm_up(self) -> None:
        """Runs a two-token prompt and one decode step through the model and the sampler, on
        pages borrowed from the pool and outside the scheduler: every kernel the engine uses gets
        compiled before a job has to wait for it (numba's CPU kernels compile for seconds the first
        time, then load from numba's disk cache; Triton compiles on first use too).

        One prefill and one decode reach every Triton variant serving can launch, because the
        kernels do not specialize on what changes from step to step (tests/engine/test_warm_up.py
        checks it against a varied batch); a mixture of experts, whose kernels take larger tiles
        for larger steps, also runs its experts once per tile shape. The detokenizer's table is
        built here too. The grammar library's view of the vocabulary is not: a worker that serves
        no structured output never needs it, and its build (a second and a half of CPU for Qwen3's
        vocabulary, holding the GIL) would hold up the warm-up; the first structured request has
        it built on the compile thread (worker/engine/grammar/compiler.py). A speculative proposer
        drafts after them (a draft model or an EAGLE-3 head runs its own kernels)."""
        with logged_step(log, "warming up: the model and the sampler run once, to compile their kernels"):
            self._warm_up()

    def _warm_up(self) -> None:
        self.tokenizer.incremental_detokenizer(skip_special_tokens=True)
        req = Request("warm-up", [0, 1], SamplingParams(temperature=0, max_tokens=2), 0, 0, None, None)
        k = self.settings.num_speculative_tokens if self.speculator is not None else 0
        req.pages = self.allocator.allocate(pages_for(3 + k, self.settings.page_size))  # prompt, a decode, a draft
        try:
            for chunk in (ScheduledChunk(req, 0, 2, True), ScheduledChunk(req, 2, 1, True)):
                sampled = self.sampler(self.runner.run([chunk]), [req], self._warm_up_mask)
                req.token_ids.append(sampled.token_ids[0])
                req.num_computed_tokens += chunk.num_tokens
                if self.speculator is not None:
                    self.speculator.observe([chunk])
            if self.speculator is not None:
                self.speculator.proposer.propose([req], [k])
        finally:
            self.allocator.decref(req.pages)
            self.scheduler.page_table.release(req)
        self.runner.model.warm_up_experts(self.settings.max_num_batched_tokens)
        warm_up_lora(self.runner.model, self.settings.max_num_batched_tokens)

    def _warm_up_mask(self, logits: torch.Tensor) -> None:
        """Masks with an all-allowing row: compiles the structured outputs' kernel, changes nothing."""
        rows = torch.zeros(1, dtype=torch.long, device=logits.device)
        everything = torch.full((1, self.masks.table.shape[1]), -1, dtype=torch.int32, device=logits.device)
        apply_token_bitmask(logits, everything, rows, rows)

    def _log_limits(self, num_pages: int) -> None:
        s = self.settings
        log.info(
            "engine: max_model_len %d, %d KV pages x %d tokens, max_running %d, max_num_batched_tokens %d, "
            "prefix cache %s, decode CUDA graphs %s, overlapped scheduling %s, eos %s",
            self.max_model_len,
            num_pages,
            s.page_size,
            s.max_running,
            s.max_num_batched_tokens,
            on_off(s.enable_prefix_cache),
            on_off(self.runner.decode_graphs is not None),
            on_off(self.overlap),
            self.eos_token_ids,
        )
        if num_pages * s.page_size < self.max_model_len:
            log.warning(
                "the KV pool holds %d tokens, fewer than max_model_len %d: a request that outgrows the "
                "pool fails with kv_capacity_exceeded",
                num_pages * s.page_size,
                self.max_model_len,
            )

    # -- the loop interface ------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        resume_token_ids: Sequence[int] = (),
        constraint: Constraint | None = None,
        adapter: str | None = None,
    ) -> None:
        """Queues a request. `priority`: lower runs sooner (as in vLLM); ties go first come, first served.

        `resume_token_ids` are output tokens an earlier run of this request already produced
        and reported (a job reclaimed from a worker that died). The request continues after
        them as if never interrupted: they count as output for usage, penalties, min_tokens
        and the seed's draws, a stop string they begin can still complete, and neither they
        nor their text are reported again. Tokens that complete its grammar end it as "stop"
        once the grammar compiles, with no new token.

        `constraint` holds the output to a grammar (worker.engine.grammar.constraint); without
        one, `params.response_format` gives it, from the first output token. It compiles on the
        compile thread while the request waits; a grammar that does not compile ends the request
        with an error (InvalidArgument's code) at a later step.

        `adapter` names the LoRA adapter it runs with (None: the base model); it waits for the
        adapter to be in a device slot (worker/engine/lora/manager.py).

        Raises InvalidArgument (naming the field) for a bad id, prompt, resume tokens or
        parameters, PromptTooLong when the prompt leaves no room for output within
        max_model_len, UnknownAdapter for an adapter this engine does not serve and AdapterError
        for a named one it refused at start (one it refuses when it reads it ends the request with
        that error at a later step).
        """
        self._check_request(request_id, prompt_token_ids, params)
        handle = self._adapter(adapter) if adapter is not None else None
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        detokenizer = self.tokenizer.incremental_detokenizer(skip_special_tokens=True)
        req = Request(
            request_id,
            prompt_token_ids,
            params,
            priority,
            next(self._arrivals),
            TextOutput(detokenizer, params.stop),
            generator,
        )
        req.adapter = handle
        self.reader.replay(req, list(resume_token_ids))
        if constraint is None and params.response_format is not None:
            constraint = Constraint.of_format(params.response_format)
        if constraint is not None:
            req.grammar = self._compile(constraint, params, resume_token_ids)
            self._compiling.append(req)
        self.reader.live[request_id] = req
        self.scheduler.add(req)

    def _compile(
        self, constraint: Constraint, params: SamplingParams, resume_token_ids: Sequence[int]
    ) -> RequestGrammar:
        compiled = self.grammars.submit(constraint, functools.partial(replayed, constraint, list(resume_token_ids)))
        ends = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
        return RequestGrammar(constraint, compiled, ends)

    def step(self) -> list[RequestOutput]:
        """Runs one batched model step; returns a delta for every request that produced a token
        or ended (including those aborted or failed since the last step).

        Overlapped (`self.overlap`), the step is launched and the previous one's deltas are
        returned while the device runs it (worker.engine.overlap)."""
        started = time.perf_counter()
        self._check_ranks()
        outputs, self._ended = self._ended, []
        if self._compiling:
            self._start_grammars(outputs)
        batch = len(self.scheduler.running)
        speculating = self.speculator is not None and self.speculator.adaptive.speculate(batch)
        if self._in_flight is not None and (self._in_flight.needs_host_tokens or speculating):
            outputs.extend(self._read(self._take_in_flight()))  # a draft follows the tokens read
        if self.lora is not None:
            self._place_adapters(outputs)
        scheduled = self.scheduler.schedule()
        for req in scheduled.failed:
            outputs.append(self.reader.end(req, req.text.finish(), []))
        if speculating:
            self.speculator.draft(scheduled, self.scheduler)
        previous = self._take_in_flight()
        try:
            self._in_flight = self._launch(scheduled.chunks, previous, outputs) if scheduled.chunks else None
        except BaseException:
            if previous is not None and not previous.read:
                self._in_flight = previous  # its placeholders still stand for its tokens
            raise
        if previous is not None and not previous.read:
            outputs.extend(self._read(previous))
        if not scheduled.chunks and self._compiling and previous is None:
            self._compiling[0].grammar.wait_compiled(COMPILE_WAIT_S)
        if not self.overlap and self._in_flight is not None:
            outputs.extend(self._read(self._take_in_flight()))
        if self.speculator is not None:
            self.speculator.measure(batch, speculating, scheduled.chunks, outputs, time.perf_counter() - started)
        return outputs

    def abort(self, request_id: str) -> bool:
        """Ends a live request; its final output (finish_reason "abort") comes with the next step."""
        req = self.scheduler.abort(request_id)
        if req is None:
            return False
        req.finish("abort")
        self._ended.append(self.reader.end(req, req.text.finish(), []))
        log.debug("aborted request %s after %d output tokens", request_id, req.num_output_tokens)
        return True

    def capacity(self) -> Capacity:
        self._check_ranks()
        sched = self.scheduler
        available = self.allocator.num_free + self.cache.evictable_pages
        return Capacity(
            free_slots=max(0, self.settings.max_running - len(sched.running) - len(sched.waiting)),
            free_pages=max(0, available - sched.pages_owed() - sched.pages_wanted_by_waiting()),
            page_size=self.settings.page_size,
        )

    def adapters(self) -> tuple[list[str], list[str]] | None:
        """(the LoRA adapters it serves, those it holds in memory); None when it serves none."""
        return None if self.lora is None else (self.lora.served(), self.lora.held())

    def has_unfinished(self) -> bool:
        self._check_ranks()
        return bool(self.reader.live or self._ended)

    def _check_ranks(self) -> None:
        """RankFailed once another rank has died: the worker's loop calls one of the three
        methods that check every iteration, busy or idle."""
        if self.ranks is not None:
            self.ranks.check()

    def stats(self) -> EngineStats:
        grammars = self.grammars.stats
        return EngineStats(
            self._steps,
            self._computed_tokens,
            self._computed_prompt_tokens,
            self.scheduler.num_preemptions,
            self.cache.queried_tokens,
            self.cache.hit_tokens,
            grammars.cache_hits,
            grammars.compiles,
            grammars.compile_seconds,
            *(self.speculator.totals if self.speculator is not None else (0, 0, 0)),
            *((self.lora.loader.reads, self.lora.slots.installs) if self.lora is not None else ()),
        )

    # -- one step ------------------------------------------------------------------------

    def _launch(
        self,
        chunks: list[ScheduledChunk],
        previous: LaunchedStep | None,
        outputs: list[RequestOutput],
    ) -> LaunchedStep | None:
        """Queues the step's model run and sampling; None when no chunk samples. When a request
        that samples has a grammar, the previous step is read (into `outputs`) between the two:
        its tokens advance the matchers whose masks this sampling needs (overlap.py)."""
        self._count_computed(chunks)
        rows = sampling_rows(chunks)
        try:
            if self.ranks is not None:
                self.ranks.start_serving()  # the warm-up's steps were start-up's, this one is served
            logits = self.runner.run(chunks, previous.device_tokens if previous is not None else None)
        except RankFailed as e:
            raise self.ranks.explain(e) if self.ranks is not None else e from None
        if self.speculator is not None:
            self.speculator.observe(chunks)
        self.scheduler.commit(chunks)
        if not rows.requests:
            return None
        constrained = any(r.grammar is not None for r in rows.requests)
        mask = None
        if constrained:
            if previous is not None and not previous.read:
                outputs.extend(self._read(previous))
            batch_mask = self.draft_masks.add_rows(self.masks.batch_mask(rows.views), rows.views)
            if batch_mask is not None:
                mask = functools.partial(self.masks.apply, mask=batch_mask)
        sampled = self.sampler.sample(logits, rows.views, mask)
        self.draft_masks.release()
        return launched(rows.requests, sampled, constrained, rows.verification)

    def _take_in_flight(self) -> LaunchedStep | None:
        step, self._in_flight = self._in_flight, None
        return step

    def _read(self, step: LaunchedStep) -> list[RequestOutput]:
        step.read = True
        if step.constrained:
            self.masks.settle()  # no fill may touch a matcher while the reader advances it
        outputs = self.reader.read(step, self.sampler.read(step.wait(), step.requests))
        if step.verification is not None:
            self.speculator.settle(step.verification, self.sampler.penalties, self.vocab_size)
        if step.constrained:
            self.masks.prefill(step.requests)  # the rows of their next step, while the loop goes on
        return outputs

    def _adapter(self, name: str):
        if self.lora is None:
            raise UnknownAdapter(name, "by this worker (it serves no LoRA adapters)")
        return self.lora.handle(name)

    def _place_adapters(self, outputs: list[RequestOutput]) -> None:
        """Adapters into slots for the waiting requests; those whose adapter was refused end with its error."""
        for handle in self.lora.prepare(self.scheduler.waiting, self.scheduler.running):
            for req in [r for r in self.scheduler.waiting if r.adapter is handle]:
                self.scheduler.abort(req.request_id)
                req.finish("error", RequestError(handle.error.code, handle.error.message))
                outputs.append(self.reader.end(req, req.text.finish(), []))

    def _start_grammars(self, outputs: list[RequestOutput]) -> None:
        """Requests whose grammar compiled since the last step can be admitted now; one whose
        grammar did not compile ends with the error, and one resumed with tokens that complete
        its grammar ends as "stop"."""
        compiling = []
        for req in self._compiling:
            if req.is_finished:
                continue  # aborted while it compiled
            if not req.grammar.compiled:
                compiling.append(req)
                continue
            error = req.grammar.start()
            if error is not None:
                self.scheduler.abort(req.request_id)
                req.finish("error", RequestError(error.code, error.message))
                log.info("request %s: its grammar does not compile: %s", req.request_id, error.message)
                outputs.append(self.reader.end(req, req.text.finish(), []))
            elif req.grammar.complete:
                outputs.append(self.reader.end_by_grammar(req))  # resumed after its output was whole
        self._compiling = compiling

    def _count_computed(self, chunks: list[ScheduledChunk]) -> None:
        self._steps += 1
        self._computed_tokens += sum(c.num_tokens for c in chunks)
        self._computed_prompt_tokens += sum(
            min(c.start + c.num_tokens, c.request.num_prompt_tokens) - c.start
            for c in chunks
            if c.start < c.request.num_prompt_tokens
        )

    def _check_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.reader.live:
            raise InvalidArgument("request_id", f"{request_id!r} is already running")
        if not prompt_token_ids:
            raise InvalidArgument("prompt_token_ids", "must not be empty")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise InvalidArgument("prompt_token_ids", f"token ids must be in [0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLong(
                "prompt_token_ids",
                f"{len(prompt_token_ids)} tokens leave no room for output within max_model_len {self.max_model_len}",
            )
        params.check_consistency()
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidArgument("stop_token_ids", f"token ids must be below the vocabulary size {self.vocab_size}")


def on_off(flag: bool) -> str:
    return "on" if flag else "off"


def overlap_enabled(settings: EngineSettings, device: torch.device) -> bool:
    # Unset, it follows the device: on CPU the host runs the model itself, so nothing overlaps.
    return settings.overlap_schedule if settings.overlap_schedule is not None else device.type == "cuda"
