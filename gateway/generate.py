"""The seed's own routes beside OpenAI's: POST /generate, one prompt to one job, and GET
/health."""

from __future__ import annotations

from typing import Literal

from openai_format.job_specs import JobSpec
from openai_format.requests import Strict
from openai_format.responses import Response, Usage


class GenerateRequest(Strict):
    prompt: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    model: str | None = None  # none: the gateway's default_queue


class GenerateResponse(Response):
    generated_text: str
    finish_reason: str
    usage: Usage


class Health(Response):
    status: Literal["ok"] = "ok"
    model_loaded: bool
    models: list[str]


def generate_job(req: GenerateRequest) -> JobSpec:
    given = {"max_tokens": req.max_tokens, "temperature": req.temperature, "top_p": req.top_p}
    return JobSpec(prompt=req.prompt, sampling={k: v for k, v in given.items() if v is not None})
