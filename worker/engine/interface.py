"""What the worker's loop needs from an engine: worker.engine.Engine (the model) and
worker.engine.echo.EchoEngine (the echo model for tests and demos) both provide it, as mypy checks
where the worker picks one (worker/__main__.py's load_engine returns an EngineAPI)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from producer_client.schema import SamplingParams
from worker.engine.outputs import Capacity, EngineStats, RequestId, RequestOutput

if TYPE_CHECKING:
    from worker.engine.grammar.constraint import Constraint


class EngineTokenizer(Protocol):
    """What the loop's intake asks of an engine's tokenizer (worker/loop/intake.py)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def token_to_id(self, token: str) -> int | None: ...
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tokenize: bool = False,
    ) -> str | list[int]: ...


class EngineAPI(Protocol):
    @property
    def tokenizer(self) -> EngineTokenizer: ...

    def add_request(
        self,
        request_id: RequestId,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        resume_token_ids: Sequence[int] = (),
        constraint: Constraint | None = None,
        adapter: str | None = None,
    ) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def abort(self, request_id: RequestId) -> bool: ...
    def capacity(self) -> Capacity: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> EngineStats: ...
    def adapters(self) -> tuple[list[str], list[str]] | None: ...
