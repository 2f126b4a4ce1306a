"""A job's events (its stream `mili:ev:{id}`): each entry has a `type` (EventType) and a `data`
JSON, which PUBLISH and CANCEL write (producer_client/protocol/worker.py, producer.py). The one
place that writes a `data` payload and the one that reads it. Two readers trust them differently:
a worker that takes a job over validates what it resumes from (a producer may write the stream,
so it is input like any other), while a client's reader takes what it shows as it comes."""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

from pydantic import BaseModel, Field, field_validator

from producer_client.chat_output import OutputFormat
from producer_client.schema import MAX_TOKEN_ID, TokenLogprob


class EventType(str, Enum):  # enum.StrEnum is 3.11's; the project runs on 3.10 too
    START = "start"  # a run began: who runs the job, since when, after how many recorded tokens
    TOKENS = "tokens"  # a piece of output
    END = "end"  # the job's result


class StartEvent(BaseModel):
    """A run's `start` event as a resumed job reads it."""

    started_at: float = Field(allow_inf_nan=False)


class TokensEvent(BaseModel):
    ids: list[int] = Field(strict=True)
    text: str = Field(strict=True)
    logprobs: list[TokenLogprob] | None = None

    @field_validator("ids")
    @classmethod
    def _token_ids(cls, ids: list[int]) -> list[int]:
        if any(not 0 <= t < MAX_TOKEN_ID for t in ids):
            raise ValueError(f"token ids must be 0 to {MAX_TOKEN_ID - 1}")
        return ids


# -- writing --------------------------------------------------------------------------------------

# json.dumps makes an encoder per call when given options; one made once serves every event.
_json_text = json.JSONEncoder(ensure_ascii=False).encode
_json_ascii = json.JSONEncoder().encode  # json.dumps's own escaping of a string
# Token ids below this keep their decimal text once made (_Decimals): every id of a model's
# vocabulary (Qwen3's 151,936), a few MB at most in a worker that writes every one of them.
DECIMAL_CACHE_IDS = 2**18


class _Decimals(dict[int, str]):
    """Each token id's decimal text, made once: a tokens event's ids are most of its cost, and an
    int's str() costs about ten times a dict's subscript (bench/RESULTS.md, y/pub7). An id's integer
    value is written (an int-like id, a bool, a numpy int, shares its int's key). Written from the
    publisher's thread and the loop's: a race makes one id's text twice, the same text."""

    def __missing__(self, token_id: int) -> str:
        text = str(int(token_id))
        if 0 <= token_id < DECIMAL_CACHE_IDS:
            self[token_id] = text
        return text


_decimal = _Decimals().__getitem__


def encode_start(worker: str, started_at: float | None, resumed_tokens: int, output_format: OutputFormat | None) -> str:
    """A run's `start` event: who runs the job, since when, after how many recorded tokens, and
    how a chat's output splits (readers of the stream parse its text with it: OutputParser)."""
    if output_format is None:  # most jobs: put together here, as json.dumps writes it, in a quarter of its time
        started = "null" if started_at is None else float.__repr__(started_at)
        return f'{{"worker": {_json_ascii(worker)}, "started_at": {started}, "resumed_tokens": {int(resumed_tokens)}}}'
    event: dict[str, Any] = {"worker": worker, "started_at": started_at, "resumed_tokens": resumed_tokens}
    event["output"] = output_format.model_dump(mode="json")
    return json.dumps(event)


def encode_tokens(token_ids: list[int], text: str, logprobs: list[TokenLogprob] | None) -> str:
    """A tokens event's JSON, {"ids": [...], "text": "...", "logprobs": [...]}. Without logprobs
    (most events) it is put together here: json.dumps of the whole dict costs twice as much."""
    if logprobs is None:
        return '{"ids":[' + ",".join(map(_decimal, token_ids)) + '],"text":' + _json_text(text) + "}"
    payload = {"ids": token_ids, "text": text, "logprobs": [lp.model_dump() for lp in logprobs]}
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


# -- reading --------------------------------------------------------------------------------------


def resumed_start(data: str) -> StartEvent:
    """A `start` event a worker resumes from: validated, raises pydantic's ValidationError."""
    return StartEvent.model_validate_json(data)


def resumed_tokens(data: str) -> TokensEvent:
    """A `tokens` event a worker resumes from: validated, raises pydantic's ValidationError."""
    return TokensEvent.model_validate_json(data)


def shown_output_format(data: str) -> OutputFormat | None:
    """How a `start` event says a chat's output splits, for a client's reader; None: plain text."""
    output = json.loads(data).get("output")
    return None if output is None else OutputFormat.model_validate(output)


def shown_tokens(data: str) -> dict[str, Any]:
    """A `tokens` event for a client's reader: its ids, text and logprobs (None, or TokenLogprobs)."""
    payload = json.loads(data)
    logprobs = payload.get("logprobs")
    return {
        "ids": payload["ids"],
        "text": payload["text"],
        "logprobs": None if logprobs is None else [TokenLogprob.model_validate(lp) for lp in logprobs],
    }
