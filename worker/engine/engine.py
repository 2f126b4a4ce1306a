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

import itertools
import logging
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from producer_client.schema import SamplingParams
from worker.engine.counts import engine_stats
from worker.engine.grammar.compiler import GrammarCompiler
from worker.engine.grammar.constraint import Constraint
from worker.engine.grammar.draft_masks import DraftMasks
from worker.engine.grammar.masks import GrammarMasks
from worker.engine.grammar_starts import GrammarStarts
from worker.engine.intake import RequestIntake
from worker.engine.kv_pool import PageAllocator
from worker.engine.lora.manager import LoraManager
from worker.engine.offline import OfflineGeneration
from worker.engine.outputs import Capacity, EngineStats, RequestId, RequestOutput
from worker.engine.radix_cache import RadixCache
from worker.engine.rank_setup import prepare_rank, resolve_max_model_len
from worker.engine.ranks import RankGroup, check_group, load_shares
from worker.engine.reader import StepReader
from worker.engine.request import DEFAULT_LANE
from worker.engine.runner import ModelRunner
from worker.engine.sampler import Sampler
from worker.engine.scheduler import Scheduler
from worker.engine.settings import EngineSettings
from worker.engine.speculative.factory import build_speculator, load_speculative_model, speculative_bytes_per_page
from worker.engine.startup import log_limits, warm_up_kernels
from worker.engine.stepper import Stepper
from worker.model.config import Qwen3Config
from worker.model.presets import model_config, resolve_model_path
from worker.model.progress import logged_step
from worker.model.qwen3 import Qwen3ForCausalLM
from worker.model.tokenizer import Tokenizer, TokenizerError

log = logging.getLogger(__name__)


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
        ring = ranks.ring if ranks is not None else None
        # Before the KV pool is sized: the adapters' slots take their memory first.
        self.lora = LoraManager.attach(model, settings, device, ring) if settings.serves_lora else None
        draft = load_speculative_model(settings, model, device)
        draft_bytes = speculative_bytes_per_page(draft, settings, device)
        memory = prepare_rank(model, config, settings, device, self.max_model_len, draft_bytes)
        num_pages = memory.num_pages
        self._build_kv_pool(num_pages)
        self.runner = ModelRunner(
            model,
            memory.kv_caches,
            settings.page_size,
            device,
            self.scheduler.page_table,
            memory.decode_graphs,
            ring,
            memory.verify_graphs,
        )
        self.sampler = Sampler(self.eos_token_ids)
        self.reader = StepReader(self.scheduler, self.eos_token_ids, self.max_model_len, self.vocab_size)
        self._build_grammars()
        self.speculator = build_speculator(settings, self.max_model_len, draft, model, self.scheduler, self.draft_masks)
        self._build_request_path()
        self._generate_ids = itertools.count()
        graphs = self.runner.decode_graphs is not None
        log_limits(settings, self.max_model_len, num_pages, graphs, self.overlap, self.eos_token_ids)

    def _build_kv_pool(self, num_pages: int) -> None:
        """The page pool, the prefix cache over it, and the scheduler that hands its pages out."""
        s = self.settings
        self.allocator = PageAllocator(num_pages)
        self.cache = RadixCache(self.allocator, s.page_size, s.enable_prefix_cache)
        self.scheduler = Scheduler(
            self.allocator, self.cache, s.page_size, s.max_running, s.max_num_batched_tokens, self.max_model_len
        )

    def _build_grammars(self) -> None:
        """The structured outputs' compiler and masks, with a verify step's rows of them."""
        # A mask covers the tokenizer's vocabulary, whose size the model's may fall short of (test models).
        mask_vocab = max(self.vocab_size, self.tokenizer.vocab_size)
        s = self.settings
        self.grammars = GrammarCompiler(
            self.tokenizer, mask_vocab, self.vocab_size, self.eos_token_ids, s.grammar_cache_size
        )
        self.masks = GrammarMasks(mask_vocab, self.eos_token_ids, s.max_running)
        self.draft_masks = DraftMasks(self.masks)  # a draft's rows of the masks (speculative decoding)

    def _build_request_path(self) -> None:
        """A request's way in (its checks, its adapter, its grammar) and its steps through the parts built before."""
        self.intake = RequestIntake(self.tokenizer, self.grammars, self.reader, self.lora, self.device)
        self.grammar_starts = GrammarStarts(self.scheduler, self.reader)
        self.stepper = Stepper(
            self.scheduler,
            self.runner,
            self.sampler,
            self.masks,
            self.reader,
            self.grammar_starts,
            self.lora,
            self.ranks,
            overlap_enabled(self.settings, self.device),
            self.speculator,
            self.draft_masks,
        )

    @property
    def overlap(self) -> bool:
        """Whether a step is launched before the previous one is read (EngineSettings.overlap_schedule)."""
        return self.stepper.overlap

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
        return cls.from_settings(model, device, dtype, EngineSettings.parse(**settings))

    @classmethod
    def from_settings(
        cls,
        model: str | Path,
        device: str | torch.device,
        dtype: torch.dtype | str | None,
        engine_settings: EngineSettings,
    ) -> Engine:
        """from_pretrained with settings already checked (a worker's, checked with the rest of its
        settings at start): they are not checked again, a lora_dir is looked at once."""
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
        """Stops the grammar compile thread (warm-up starts it) and the other ranks of a
        tensor-parallel engine."""
        self.grammars.shutdown()
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
        for larger steps, also runs its experts once per tile shape, and a model that serves LoRA
        adapters their kernels at each block size. A speculative proposer drafts after them (a draft
        model or an EAGLE-3 head runs its own kernels).

        The detokenizer's table is built here too, and the grammar library's view of the
        vocabulary, on the compile thread while the kernels run (worker/engine/grammar/compiler.py):
        its build (about a second of CPU for Qwen3's vocabulary, ~110 MiB more RSS) holds the GIL
        for up to 0.9 s in one stretch, inside llguidance. Built at the first structured request,
        as it was, it stopped a serving worker's loop that long:
        every running job's next token, and the heartbeat that keeps the worker's entries from
        being reclaimed (on a loaded host past a 2 s claim_idle_ms: a live worker lost its jobs to
        another)."""
        with logged_step(log, "warming up: the model and the sampler run once, to compile their kernels"):
            grammar_tables = self.grammars.prepare()
            self.tokenizer.incremental_detokenizer(skip_special_tokens=True)
            page_table = self.scheduler.page_table
            warm_up_kernels(
                self.runner, self.sampler, self.masks, self.allocator, page_table, self.settings, self.speculator
            )
            await_grammar_tables(grammar_tables)

    # -- the loop interface ------------------------------------------------------------

    def add_request(
        self,
        request_id: RequestId,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        resume_token_ids: Sequence[int] = (),
        constraint: Constraint | None = None,
        adapter: str | None = None,
        lane: int = DEFAULT_LANE,
    ) -> None:
        """Queues a request. `lane` (0 priority, 1 default, 2 flex: the queue's lanes) ranks it
        first: a request that cannot start for want of a slot or pages preempts running requests
        of lower lanes (see Scheduler). Within a lane, `priority`: lower runs sooner (as in vLLM);
        ties go first come, first served.

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
        req = self.intake.build(
            request_id, prompt_token_ids, params, priority, resume_token_ids, constraint, adapter, lane
        )
        if req.grammar is not None:
            self.grammar_starts.add(req)
        self.reader.live[request_id] = req
        self.scheduler.add(req)

    def step(self) -> list[RequestOutput]:
        """Runs one batched model step; returns a delta for every request that produced a token
        or ended (including those aborted or failed since the last step).

        Overlapped (`self.overlap`), the step is launched and the previous one's deltas are
        returned while the device runs it (worker.engine.overlap)."""
        self._check_ranks()
        return self.stepper.step()

    def abort(self, request_id: RequestId) -> bool:
        """Ends a live request; its final output (finish_reason "abort") comes with the next step."""
        req = self.scheduler.abort(request_id)
        if req is None:
            return False
        req.finish("abort")
        self.stepper.ended.append(self.reader.end(req, req.text.finish(), []))
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
        return bool(self.reader.live or self.stepper.ended)

    def _check_ranks(self) -> None:
        """RankFailed once another rank has died: the worker's loop calls one of the three
        methods that check every iteration, busy or idle."""
        if self.ranks is not None:
            self.ranks.check()

    def stats(self) -> EngineStats:
        return engine_stats(self.stepper.counts, self.scheduler, self.cache, self.grammars, self.speculator, self.lora)


def overlap_enabled(settings: EngineSettings, device: torch.device) -> bool:
    # Unset, it follows the device: on CPU the host runs the model itself, so nothing overlaps.
    return settings.overlap_schedule if settings.overlap_schedule is not None else device.type == "cuda"


def await_grammar_tables(built: Future) -> None:
    """Waits for the grammar library's vocabulary; a tokenizer it cannot take (not byte-level BPE)
    leaves structured outputs off, and each structured request fails with that error, as before."""
    try:
        built.result()
    except TokenizerError as error:
        log.info("structured outputs are off: %s", error)
