"""The operator's views of a client's queue, shared by Client and AsyncClient: each class names the
driver of its operations' steps (producer_client.steps.run, or .arun for asyncio)."""

from __future__ import annotations

from producer_client.dead_letters import DeadLetters
from producer_client.inspection import QueueInspector


class OperatorViews:
    @property
    def dead_letters(self) -> DeadLetters:
        """The queue's dead letters: list, get, retry, purge (producer_client.dead_letters)."""
        return DeadLetters(self.redis, self.keys, self.queue, self.run_steps)

    @property
    def inspect(self) -> QueueInspector:
        """What the queue holds now: waiting and running jobs, depth, workers (producer_client.inspection)."""
        return QueueInspector(self.redis, self.keys, self.queue, self.run_steps)
