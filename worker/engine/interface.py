"""What the worker's loop needs from an engine: worker.engine.Engine (the model) and
worker.engine.echo.EchoEngine (the echo model for tests and demos) both provide it. A request id
is any hashable value the loop chooses; every output carries it back."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol


class EngineAPI(Protocol):
    tokenizer: Any

    def add_request(
        self,
        request_id: Hashable,
        prompt_token_ids: list[int],
        params: Any,
        priority: int = 0,
        resume_token_ids: Any = (),
        constraint: Any = None,
        adapter: str | None = None,
    ) -> None: ...
    def step(self) -> list: ...
    def abort(self, request_id: Hashable) -> bool: ...
    def capacity(self) -> Any: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> Any: ...
    def adapters(self) -> tuple[list[str], list[str]] | None: ...
