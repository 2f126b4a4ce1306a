"""The worker's publisher: a thread that sends one round of publication at a time (every update
going out, and looks at jobs' hashes, in one pipeline) and keeps Redis's answer until the queue
loop picks it up. So the loop never waits for Redis to answer a publication: the next engine step
starts at once, and the output of the steps that run meanwhile goes out with the next round. Only
the round's packing, its round trip and the parsing of its replies happen here; what the replies
mean is settled in the loop's thread (worker/loop/publication.py), which alone touches the jobs."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from worker.loop.job_commands import JobCommands
from worker.loop.outbox import Update


@dataclass
class Round:
    updates: list[Update]
    watch: list[tuple[str, str]]  # (job id, run) of the jobs looked at
    forget: list[str] = field(default_factory=list)  # jobs whose done stream goes (worker/loop/done_sweep.py)
    published: list[Any] = field(default_factory=list)  # a reply (or error) per update
    watched: list[Any] = field(default_factory=list)  # a state (or error) per job looked at
    error: Exception | None = None  # the round failed as a whole: Redis took none of it, or some
    seconds: float = 0.0  # from sending it to its answer


class Publisher:
    def __init__(self, commands: JobCommands):
        self.commands = commands
        self.changed = threading.Condition()
        self.sending: Round | None = None
        self.answered: Round | None = None
        self.closed = False
        self.thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        """A round is out, or answered and not yet taken."""
        return self.sending is not None or self.answered is not None

    def send(self, round_: Round) -> None:
        with self.changed:
            if self.thread is None:
                self.thread = threading.Thread(target=self._serve, name="publisher", daemon=True)
                self.thread.start()
            self.sending = round_
            self.changed.notify_all()

    def take_answer(self, timeout: float | None = 0.0) -> Round | None:
        """The answered round, if any: waiting up to `timeout` seconds (None: as long as it takes)
        for the one out."""
        with self.changed:
            if timeout != 0.0:
                self.changed.wait_for(lambda: self.sending is None, timeout)
            answered, self.answered = self.answered, None
            return answered

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()
        if self.thread is not None:
            self.thread.join()

    def _serve(self) -> None:
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.sending is not None or self.closed)
                round_ = self.sending
            if round_ is None:
                return
            started = time.monotonic()
            try:
                round_.published, round_.watched = self.commands.publish(round_.updates, round_.watch, round_.forget)
            except Exception as e:  # the loop's thread judges it, as it judges any failed exchange
                round_.error = e
            round_.seconds = time.monotonic() - started
            with self.changed:
                self.answered, self.sending = round_, None
                self.changed.notify_all()
