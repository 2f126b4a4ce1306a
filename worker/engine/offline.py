"""The engine as a library (`Engine.generate`): prompts in, finished outputs out, in input order,
the engine stepped until every request has ended."""

from __future__ import annotations

import logging
import time

from producer_client.errors import InvalidArgument, MiliError
from producer_client.schema import SamplingParams
from worker.engine.outputs import GenerationOutput, RequestError, RequestId, TokenCounts
from worker.engine.request import Request

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 10.0


class OfflineGeneration:
    """Engine.generate and what it needs; the engine provides tokenizer, add_request, step,
    reader (its live requests), scheduler, _generate_ids and close. As a context manager, the
    engine is closed at the end of the block (an engine of several ranks stops them)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        adapters: list[str | None] | None = None,
    ) -> list[GenerationOutput]:
        """Runs the prompts (text, or token id lists) to completion; outputs in input order.

        `adapters`: the LoRA adapter each prompt runs with (None: the base model).
        A request that cannot run (too long, bad token ids, an unknown adapter) gets an output
        with finish_reason "error" and its code, and the others still run. It steps the whole engine, so it is
        not for an engine that a loop also feeds through add_request.
        """
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidArgument("params", f"{len(params_list)} sampling params for {len(prompts)} prompts")
        adapters = adapters if adapters is not None else [None] * len(prompts)
        if len(adapters) != len(prompts):
            raise InvalidArgument("adapters", f"{len(adapters)} adapters for {len(prompts)} prompts")
        results: list[GenerationOutput | None] = [None] * len(prompts)
        index: dict[str, tuple[int, Request]] = {}
        for i, (prompt, p, adapter) in enumerate(zip(prompts, params_list, adapters)):
            request_id = f"generate-{next(self._generate_ids)}"
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            try:
                self.add_request(request_id, ids, p, adapter=adapter)
            except MiliError as e:
                results[i] = rejected_output(request_id, ids, e)
                continue
            index[request_id] = (i, self.reader.live[request_id])
        self._run_to_completion(index, results)
        return results  # type: ignore[return-value]

    def _run_to_completion(self, index: dict[str, tuple[int, Request]], results: list) -> None:
        start = last_report = time.monotonic()
        done = out_tokens = 0
        while done < len(index):
            for out in self.step():
                out_tokens += len(out.new_token_ids)
                if out.finished and out.request_id in index:
                    i, req = index[out.request_id]
                    results[i] = generation_output(req)
                    done += 1
            now = time.monotonic()
            if now - last_report >= PROGRESS_EVERY_S:
                last_report = now
                log.info(
                    "generate: %d/%d done, %d output tokens, %.1f tok/s, %d running, %d waiting",
                    done,
                    len(index),
                    out_tokens,
                    out_tokens / (now - start),
                    len(self.scheduler.running),
                    len(self.scheduler.waiting),
                )


def generation_output(req: Request) -> GenerationOutput:
    return GenerationOutput(
        req.request_id,
        req.prompt_token_ids,
        req.output_token_ids,
        req.text.text,
        req.finish_reason,
        req.usage(),
        req.logprobs,
        req.error,
    )


def rejected_output(request_id: RequestId, prompt_token_ids: list[int], error: MiliError) -> GenerationOutput:
    return GenerationOutput(
        request_id,
        prompt_token_ids,
        [],
        "",
        "error",
        TokenCounts(len(prompt_token_ids), 0, 0),
        None,
        RequestError(error.code, error.message),
    )
