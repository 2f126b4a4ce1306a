"""Wire models shared by the client and the worker (pydantic only: no torch here)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from producer_client.errors import InvalidArgument

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20


class SamplingParams(BaseModel):
    """Sampling parameters with the names users know from OpenAI and vLLM."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(256, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # 0 = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @classmethod
    def parse(cls, **kwargs) -> "SamplingParams":
        """Build and validate, raising InvalidArgument that names the first bad field."""
        try:
            params = cls(**kwargs)
        except ValidationError as e:
            raise invalid_argument_from(e) from None
        params.check_consistency()
        return params

    def check_consistency(self) -> None:
        if self.min_tokens > self.max_tokens:
            raise InvalidArgument("min_tokens", "must not exceed max_tokens")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidArgument("stop", f"each stop string must be 1..{MAX_STOP_STRING_CHARS} characters")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidArgument("stop_token_ids", "token ids must be non-negative")


def invalid_argument_from(error: ValidationError) -> InvalidArgument:
    first = error.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "body"
    return InvalidArgument(field, first["msg"])
