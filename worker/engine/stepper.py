"""One batched step after another: grammars that compiled start, waiting requests' LoRA adapters
go into device slots, the scheduler picks chunks, the runner extends their KV and returns logits,
the sampler picks tokens (masked by grammars) and the reader turns them into deltas. Overlapped, a
step is launched before the previous one is read, so that the host prepares one step while the
device runs the other (worker.engine.overlap). With speculative decoding, a step the adaptive rule
lets speculate gives its decodes drafts, verified in the same step (worker.engine.speculative)."""

from __future__ import annotations

import functools
import time

from worker.engine.counts import StepCounts
from worker.engine.grammar.draft_masks import DraftMasks
from worker.engine.grammar.masks import GrammarMasks
from worker.engine.grammar_starts import GrammarStarts
from worker.engine.lora.manager import LoraManager
from worker.engine.outputs import RequestError, RequestOutput
from worker.engine.overlap import LaunchedStep, launched
from worker.engine.ranks import RankGroup
from worker.engine.reader import StepReader
from worker.engine.runner import ModelRunner
from worker.engine.sampler import Sampler
from worker.engine.scheduler import ScheduledChunk, Scheduler
from worker.engine.speculative.speculator import Speculator
from worker.engine.speculative.verify import sampling_rows
from worker.model.rank_failed import RankFailed


class Stepper:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        sampler: Sampler,
        masks: GrammarMasks,
        reader: StepReader,
        grammar_starts: GrammarStarts,
        lora: LoraManager | None,
        ranks: RankGroup | None,
        overlap: bool,
        speculator: Speculator | None,
        draft_masks: DraftMasks,
    ):
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.masks = masks
        self.reader = reader
        self.grammar_starts = grammar_starts
        self.lora = lora
        self.ranks = ranks
        self.overlap = overlap
        self.speculator = speculator  # drafts decodes and settles their verify steps (None: no speculation)
        self.draft_masks = draft_masks  # a verify step's rows of the grammars' masks
        self.in_flight: LaunchedStep | None = None  # overlapped: the step the device may still be running
        self.ended: list[RequestOutput] = []  # finals of requests that ended between steps (aborts)
        self.counts = StepCounts()

    def step(self) -> list[RequestOutput]:
        """Engine.step, once the ranks are checked."""
        started = time.perf_counter()
        outputs, self.ended = self.ended, []
        if self.grammar_starts.compiling:
            self.grammar_starts.start_compiled(outputs)
        batch = len(self.scheduler.running)
        speculating = self.speculator is not None and self.speculator.adaptive.speculate(batch)
        if self.in_flight is not None and (self.in_flight.needs_host_tokens or speculating):
            outputs.extend(self._read(self._take_in_flight()))  # a draft follows the tokens read
        if self.lora is not None:
            self._place_adapters(self.lora, outputs)
        scheduled = self.scheduler.schedule()
        for req in scheduled.failed:
            outputs.append(self.reader.end(req, req.text.finish(), []))
        if speculating:
            self.speculator.draft(scheduled, self.scheduler)
        previous = self._take_in_flight()
        try:
            self.in_flight = self._launch(scheduled.chunks, previous, outputs) if scheduled.chunks else None
        except BaseException:
            if previous is not None and not previous.read:
                self.in_flight = previous  # its placeholders still stand for its tokens
            raise
        if previous is not None and not previous.read:
            outputs.extend(self._read(previous))
        if not scheduled.chunks and self.grammar_starts.compiling and previous is None:
            self.grammar_starts.wait_a_little()
        if not self.overlap and self.in_flight is not None:
            outputs.extend(self._read(self._take_in_flight()))
        if self.speculator is not None:
            self.speculator.measure(batch, speculating, scheduled.chunks, outputs, time.perf_counter() - started)
        return outputs

    def _place_adapters(self, lora: LoraManager, outputs: list[RequestOutput]) -> None:
        """Adapters into slots for the waiting requests; those whose adapter was refused end with its error."""
        for handle in lora.prepare(self.scheduler.waiting, self.scheduler.running):
            for req in [r for r in self.scheduler.waiting if r.adapter is handle]:
                self.scheduler.abort(req.request_id)
                req.finish("error", RequestError(handle.error.code, handle.error.message))
                outputs.append(self.reader.end(req, req.text.finish(), []))

    def _launch(
        self,
        chunks: list[ScheduledChunk],
        previous: LaunchedStep | None,
        outputs: list[RequestOutput],
    ) -> LaunchedStep | None:
        """Queues the step's model run and sampling; None when no chunk samples. When a request
        that samples has a grammar, the previous step is read (into `outputs`) between the two:
        its tokens advance the matchers whose masks this sampling needs (overlap.py)."""
        self.counts.count(chunks)
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
        step, self.in_flight = self.in_flight, None
        return step

    def _read(self, step: LaunchedStep) -> list[RequestOutput]:
        step.read = True
        if step.constrained:
            self.masks.settle()  # no fill may touch a matcher while the reader advances it
        outputs = self.reader.read(step, self.sampler.read(step.wait(), step.requests))
        if step.verification is not None:
            self.speculator.settle(step.verification, self.sampler.penalties, self.reader.vocab_size)
        if step.constrained:
            self.masks.prefill(step.requests)  # the rows of their next step, while the loop goes on
        return outputs
