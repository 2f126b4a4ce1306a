"""A worker process for bench/publish.py, instrumented: `python bench/publish_probe.py TREE OUT.json
[worker flags...]` runs `python -m worker serve` from the source tree TREE (this branch's, or a
worktree of an older commit: the benchmark runs both in one run), and writes to OUT.json when it
stops:

- `steps`: how many engine steps ran;

each of the next three only between two steps of which the first left a job running (the time
the engine sat idle, waiting for jobs, is none of publication's doing):
- `stalls`: for each step, how long the queue loop spent on publication between that step's end
  and the next step's start (the time a GPU step would wait on it): the loop thread's time in
  `Publication.publish`, whichever class the tree's loop hands publication to;
- `gaps`: the loop's whole time between two steps (reading, admitting, publishing);
- `periods`: the time from one step's outputs to the next's;
- with `--samples`, when each job's tokens were sampled: {job id: [epoch seconds per token]} (the
  wall clock, which Redis's event ids and the readers share on one machine), made when the worker
  stops from each step's request ids and token counts: little of the noting is in the worker's CPU;
- `engine_cpu_s`: the loop thread's CPU time inside the engine's steps (the echo engine's own work,
  which a model's engine does in its own way), so that the worker's CPU can be read without it.

With `--device-step-ms MS` each echo step stands for a GPU step of MS ms, overlapped as the engine's
overlap scheduler runs on a GPU (bench/device_pace.py, its constant model): the host's work
between steps is then hidden while it takes less than MS ms, and `periods` stays flat at MS.

With `--inline-publisher` (this branch's tree only) each publication round is sent in the loop's
own thread, as the overlap scheduler's idle time would carry it, instead of the publisher's thread:
the other design issue 25 asked to measure.

Nothing of the tree is imported before TREE leads sys.path, so each tree's own code is measured.
"""

from __future__ import annotations

import json
import sys
import threading
import time

# This file's directory leads sys.path until main() puts the tree there (it runs as a script).
from device_pace import DeviceStep, pace_like_a_device


def main() -> int:
    tree, out_path, *argv = sys.argv[1:]
    samples = "--samples" in argv
    if samples:
        argv.remove("--samples")
    inline = "--inline-publisher" in argv
    if inline:
        argv.remove("--inline-publisher")
    device_step_ms = 0.0
    if "--device-step-ms" in argv:
        at = argv.index("--device-step-ms")
        device_step_ms = float(argv[at + 1])
        del argv[at : at + 2]
    # Run as a script (the baseline tree has no copy of it), so this checkout's bench/ leads
    # sys.path: the measured tree takes its place, and its packages are the ones imported.
    sys.path[0] = tree
    from worker import __main__ as worker_main
    from worker.engine.echo import EchoEngine
    from worker.loop.publication import Publication
    from worker.loop.service import Worker

    if device_step_ms:
        pace_like_a_device(EchoEngine, DeviceStep(device_step_ms))
    if inline:
        from worker.loop.publisher import Publisher

        send_inline(Publisher)
    probe = Probe(samples)
    probe.wrap_step(Worker)
    probe.wrap_publication(Publication)
    try:
        return worker_main.main(["serve", *argv])
    finally:
        with open(out_path, "w") as f:
            json.dump(probe.report(), f)


def send_inline(publisher_class) -> None:
    """Each round sent and answered in the caller's thread (the loop's), within send()."""

    def send(self, round_) -> None:
        started = time.monotonic()
        try:
            round_.published, round_.watched = self.commands.publish(round_.updates, round_.watch)
        except Exception as e:
            round_.error = e
        round_.seconds = time.monotonic() - started
        self.answered = round_

    publisher_class.send = send


class Probe:
    def __init__(self, samples: bool):
        self.loop_thread = threading.main_thread()
        self.steps = 0
        self.stalls: list[float] = []
        self.gaps: list[float] = []
        self.periods: list[float] = []
        self.in_publication = 0.0  # the loop's time in publication since the last step ended
        self.step_ended: float | None = None
        self.running = False  # the last step left a job running
        self.samples = samples
        # With samples, per step: (epoch seconds, its outputs' request ids, their token counts); plain
        # lists, not the outputs, which kept alive would each be one more object for the cyclic
        # garbage collector to scan at every full collection.
        self.stepped: list[tuple[float, list, list[int]]] = []
        self.engine_cpu_s = 0.0

    def wrap_step(self, worker_class) -> None:
        probe = self
        step = worker_class._step

        def timed_step(self):
            started = time.monotonic()
            busy = probe.step_ended is not None and probe.running
            if busy:
                probe.gaps.append(started - probe.step_ended)
                probe.stalls.append(probe.in_publication)
            cpu = time.thread_time()
            outputs = step(self)
            probe.engine_cpu_s += time.thread_time() - cpu
            ended = time.monotonic()
            if busy:
                probe.periods.append(ended - probe.step_ended)
            probe.step_ended = ended
            probe.running = any(not out.finished for out in outputs)
            probe.in_publication = 0.0
            probe.steps += 1
            if probe.samples:
                probe.stepped.append(
                    (time.time(), [out.request_id for out in outputs], [len(out.new_token_ids) for out in outputs])
                )
            return outputs

        worker_class._step = timed_step

    def wrap_publication(self, publication_class) -> None:
        probe = self
        publish = publication_class.publish

        def timed_publish(self, *args, **kwargs):
            if threading.current_thread() is not probe.loop_thread:
                return publish(self, *args, **kwargs)
            started = time.monotonic()
            try:
                return publish(self, *args, **kwargs)
            finally:
                probe.in_publication += time.monotonic() - started

        publication_class.publish = timed_publish

    def sampled(self) -> dict[str, list[float]] | None:
        if not self.samples:
            return None
        at_by_job: dict[str, list[float]] = {}
        for at, request_ids, counts in self.stepped:
            for request_id, count in zip(request_ids, counts):
                if count:
                    at_by_job.setdefault(request_id.job_id, []).extend([at] * count)
        return at_by_job

    def report(self) -> dict:
        return {
            "steps": self.steps,
            "stalls": self.stalls,
            "gaps": self.gaps,
            "periods": self.periods,
            "engine_cpu_s": self.engine_cpu_s,
            "samples": self.sampled(),
        }


if __name__ == "__main__":
    sys.exit(main())
