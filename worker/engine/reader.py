"""Reading a step's tokens: each token goes in place of its placeholder and is checked against
its request's stop conditions, in vLLM's order (stop tokens, stop strings, length, with a
grammar's completion before length), and turned into a delta; a request whose logits were not
finite, or whose grammar refuses its token, fails instead; a request that ends leaves the
engine's live set."""

from __future__ import annotations

import logging

from producer_client.errors import InvalidArgument, MiliError
from worker.engine.errors import NonFiniteLogits, StructuredOutputError
from worker.engine.outputs import (
    FinishReason,
    RequestError,
    RequestId,
    RequestOutput,
    SampledLogprob,
    token_output,
)
from worker.engine.overlap import LaunchedStep, drop_placeholders
from worker.engine.request import Request, RequestStatus
from worker.engine.sampler import SampledTokens, skip_draws
from worker.engine.scheduler import Scheduler
from worker.engine.speculative.verify import Verification

log = logging.getLogger(__name__)


class StepReader:
    def __init__(self, scheduler: Scheduler, eos_token_ids: list[int], max_model_len: int, vocab_size: int):
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.live: dict[RequestId, Request] = {}  # every request added and not yet ended

    def read(self, step: LaunchedStep, sampled: SampledTokens) -> list[RequestOutput]:
        """The step's tokens, in order, each in place of its placeholder. A request whose logits
        were not finite fails instead, without the token drawn from them."""
        if step.verification is not None:
            return self._read_verified(step, sampled, step.verification)
        outputs = []
        rows = zip(step.requests, step.indices, sampled.token_ids, sampled.logprobs, sampled.finite)
        for req, index, token, lp, finite in rows:
            if req.status is RequestStatus.FINISHED:
                continue  # it ended while this token was in flight: the token is discarded
            outputs.append(self._take_row(req, index, token, lp, finite))
        return outputs

    def _read_verified(
        self, step: LaunchedStep, sampled: SampledTokens, verification: Verification
    ) -> list[RequestOutput]:
        """A verify step's rows: a request's row i counts once rows 0..i-1 drew its draft's first
        i tokens, and then that draft token's KV is the request's too (speculative/verify.py). A
        request's tokens come in one output."""
        outputs: list[RequestOutput] = []
        rejected: set[Request] = set()  # requests whose draft was cut at an earlier row
        rows = zip(
            step.requests,
            step.indices,
            sampled.token_ids,
            sampled.logprobs,
            sampled.finite,
            verification.offsets,
            verification.expected,
        )
        for req, index, token, lp, finite, offset, expected in rows:
            if req.status is RequestStatus.FINISHED or req in rejected:
                continue
            if offset > 0:
                self.scheduler.accept_draft_token(req)
                verification.num_accepted += 1
                if req.grammar is not None:
                    req.grammar.advance()  # the drafted token just taken: whether it completed the output
            output = self._take_row(req, index, token, lp, finite)
            if outputs and outputs[-1].request_id == req.request_id:
                merge_into(outputs[-1], output)
            else:
                outputs.append(output)
            if not req.is_finished and token != expected:
                rejected.add(req)
                del req.token_ids[index + 1 :]  # the placeholders of the rows that no longer count
        return outputs

    def _take_row(self, req: Request, index: int, token: int, lp: SampledLogprob | None, finite: bool) -> RequestOutput:
        if finite:
            return self._take_token(req, index, token, lp)
        del req.token_ids[index:]
        return self._fail(
            req,
            NonFiniteLogits(
                f"request {req.request_id}: non-finite logits (a NaN or an infinity) at output token "
                f"{req.num_output_tokens + 1}"
            ),
        )

    def replay(self, req: Request, resume_token_ids: list[int]) -> None:
        """Brings a new request to where it stood after producing `resume_token_ids`."""
        if resume_token_ids and (min(resume_token_ids) < 0 or max(resume_token_ids) >= self.vocab_size):
            raise InvalidArgument("resume_token_ids", f"token ids must be in [0, {self.vocab_size})")
        for n, token in enumerate(resume_token_ids, 1):
            req.token_ids.append(token)
            _, reason = self._check_stop(req, token, n)
            if reason is not None:
                raise InvalidArgument("resume_token_ids", f"the request had already ended ({reason}) at token {n}")
        skip_draws(req, len(resume_token_ids), self.vocab_size)

    def end(
        self,
        req: Request,
        text: str,
        new_token_ids: list[int],
        logprobs: list[SampledLogprob] | None = None,
    ) -> RequestOutput:
        """The request's final output; it leaves the live set."""
        del self.live[req.request_id]
        drop_placeholders(req)
        if req.grammar is not None:
            req.grammar.close()
        log.debug(
            "request %s finished (%s): %d prompt tokens (%d cached), %d output tokens, %d preemptions",
            req.request_id,
            req.finish_reason,
            req.num_prompt_tokens,
            req.num_cached_prompt_tokens,
            req.num_output_tokens,
            req.num_preemptions,
        )
        return RequestOutput(
            req.request_id,
            new_token_ids,
            text,
            True,
            req.finish_reason,
            req.usage(),
            logprobs,
            req.error,
        )

    def _take_token(self, req: Request, index: int, token: int, logprob: SampledLogprob | None) -> RequestOutput:
        """Puts `token` where its placeholder is, at `index`. A step launched since may have
        appended its own placeholder after it: that one stays, unless this token ends the request.
        A request whose grammar ended before this token ends without it."""
        if req.grammar is not None and req.grammar.ended:
            del req.token_ids[index:]
            return self.end_by_grammar(req)
        req.token_ids[index] = token
        if logprob is not None:
            req.logprobs.append(logprob)
        num_output = index + 1 - req.num_prompt_tokens
        text, reason = self._check_stop(req, token, num_output)
        logprobs = [logprob] if logprob is not None else None
        if reason is None:
            return token_output(
                req.request_id, token, text, req.num_prompt_tokens, num_output, req.num_cached_prompt_tokens, logprobs
            )
        del req.token_ids[index + 1 :]
        req.finish(reason)
        self.scheduler.finish(req)
        return self.end(req, text, [token], logprobs)

    def end_by_grammar(self, req: Request) -> RequestOutput:
        """Ends a request whose grammar ended: "stop" with no new token if the output is whole,
        failed if the grammar refused it."""
        if req.grammar.error is not None:
            return self._fail(req, StructuredOutputError(req.grammar.error))
        req.finish("stop")
        self.scheduler.finish(req)
        return self.end(req, req.text.finish(), [])

    def _fail(self, req: Request, error: MiliError) -> RequestOutput:
        """Ends the request with the output it had; the rest of the batch is unaffected (rows
        never mix)."""
        req.finish("error", RequestError(error.code, error.message))
        self.scheduler.finish(req)
        log.warning("request %s: %s", req.request_id, error.message)
        return self.end(req, req.text.finish(), [])

    def _check_stop(self, req: Request, token: int, num_output: int) -> tuple[str, FinishReason | None]:
        """(text delta, finish reason or None) for the request's `num_output`-th output token,
        `token`, in vLLM's order: stop tokens, stop strings, length.

        Before min_tokens nothing stops the request (its stop tokens were also masked out of
        sampling), nor before its grammar accepts the output (a stop id is then an ordinary
        token). A stop token's own text is not emitted; a stop string is cut from the text. The
        grammar takes the token here, so this is the token's one reading; at max_tokens, a
        grammar that the token completes ends the request as "stop": the output is whole.
        """
        p = req.params
        can_stop = num_output >= p.min_tokens and (req.grammar is None or req.grammar.accepts_end)
        if can_stop and (token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
            return req.text.finish(), "stop"
        if req.grammar is not None:
            req.grammar.take(token)
        text, stopped = req.text.push(token, can_stop)
        if stopped:
            return text, "stop"
        if req.ends_by_length(num_output, self.max_model_len):
            return text + req.text.finish(), self._reason_at_length(req)
        return text, None

    @staticmethod
    def _reason_at_length(req: Request) -> FinishReason:
        if req.grammar is not None and req.grammar.started:
            req.grammar.advance()
            if req.grammar.complete:
                return "stop"
        return "length"


def merge_into(first: RequestOutput, then: RequestOutput) -> None:
    """`then`, the same request's next output of the step, appended to `first`."""
    first.new_token_ids += then.new_token_ids
    first.text_delta += then.text_delta
    if then.logprobs is not None:
        first.logprobs = (first.logprobs or []) + then.logprobs
    first.finished, first.finish_reason, first.usage, first.error = (
        then.finished,
        then.finish_reason,
        then.usage,
        then.error,
    )
