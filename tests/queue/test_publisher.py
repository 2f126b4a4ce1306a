"""The publisher's thread (worker/loop/publisher.py) on its own, with a stand-in for the job
commands: a round handed over while the loop's read is out waits for the read's answer."""

from __future__ import annotations

import threading

from worker.loop.publisher import Publisher, Round


class RecordingCommands:
    """Answers every round at once, and says when one was sent."""

    def __init__(self) -> None:
        self.sent = threading.Event()
        self.rounds = 0

    def publish(self, updates, watch, forget=()):
        self.rounds += 1
        self.sent.set()
        return [], [("state", job_id) for job_id, _ in watch]


def test_a_round_waits_while_the_loops_read_is_out_and_goes_once_it_is_answered():
    commands = RecordingCommands()
    publisher = Publisher(commands)  # type: ignore[arg-type]  # a stand-in for JobCommands
    try:
        with publisher.held():
            publisher.send(Round([], [("job-1", "run-1")]))
            assert not commands.sent.wait(0.2)  # several times what the thread takes to send it
            assert (commands.rounds, publisher.busy) == (0, True)
        answered = publisher.take_answer(timeout=10)
        assert answered is not None
        assert (commands.rounds, answered.watched, answered.error) == (1, [("state", "job-1")], None)
    finally:
        publisher.close()


def test_a_held_publisher_still_closes_after_sending_the_round_out():
    """close() during a hold (the loop stopped mid-read): the round handed over is not lost."""
    commands = RecordingCommands()
    publisher = Publisher(commands)  # type: ignore[arg-type]
    with publisher.held():
        publisher.send(Round([], [("job-1", "run-1")]))
        closing = threading.Thread(target=publisher.close)
        closing.start()
        closing.join(10)
    assert not closing.is_alive()
    assert commands.rounds == 1
