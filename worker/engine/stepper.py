"""One batched step after another: grammars that compiled start, waiting requests' LoRA adapters
go into device slots, the scheduler picks chunks, the runner extends their KV and returns logits,
the sampler picks tokens (masked by grammars) and the reader turns them into deltas. Overlapped, a
step is launched before the previous one is read, so that the host prepares one step while the
device runs the other (worker.engine.overlap)."""

from __future__ import annotations

import functools

from worker.engine.counts import StepCounts
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
        self.in_flight: LaunchedStep | None = None  # overlapped: the step the device may still be running
        self.ended: list[RequestOutput] = []  # finals of requests that ended between steps (aborts)
        self.counts = StepCounts()

    def step(self) -> list[RequestOutput]:
        """Engine.step, once the ranks are checked."""
        outputs, self.ended = self.ended, []
        if self.grammar_starts.compiling:
            self.grammar_starts.start_compiled(outputs)
        if self.in_flight is not None and self.in_flight.needs_host_tokens:
            outputs.extend(self._read(self._take_in_flight()))
        if self.lora is not None:
            self._place_adapters(self.lora, outputs)
        scheduled = self.scheduler.schedule()
        for req in scheduled.failed:
            outputs.append(self.reader.end(req, req.text.finish(), []))
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
        sampling = [c.request for c in chunks if c.samples]
        try:
            if self.ranks is not None:
                self.ranks.start_serving()  # the warm-up's steps were start-up's, this one is served
            logits = self.runner.run(chunks, previous.device_tokens if previous is not None else None)
        except RankFailed as e:
            raise self.ranks.explain(e) if self.ranks is not None else e from None
        self.scheduler.commit(chunks)
        if not sampling:
            return None
        constrained = any(r.grammar is not None for r in sampling)
        mask = None
        if constrained:
            if previous is not None and not previous.read:
                outputs.extend(self._read(previous))
            batch_mask = self.masks.batch_mask(sampling)
            if batch_mask is not None:
                mask = functools.partial(self.masks.apply, mask=batch_mask)
        return launched(sampling, self.sampler.sample(logits, sampling, mask), constrained)

    def _take_in_flight(self) -> LaunchedStep | None:
        step, self.in_flight = self.in_flight, None
        return step

    def _read(self, step: LaunchedStep) -> list[RequestOutput]:
        step.read = True
        if step.constrained:
            self.masks.settle()  # no fill may touch a matcher while the reader advances it
        outputs = self.reader.read(step, self.sampler.read(step.wait(), step.requests))
        if step.constrained:
            self.masks.prefill(step.requests)  # the rows of their next step, while the loop goes on
        return outputs
