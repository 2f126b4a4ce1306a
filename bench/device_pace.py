"""Echo steps paced like a GPU's, for the benchmarks that measure the queue at a device's pace
(bench/publish.py's -gpu cases through bench/publish_probe.py, bench/tenants.py's and
bench/isolation_ab.py's GPU-paced isolation rows).

Each echo step stands for a GPU step, overlapped as the engine's overlap scheduler runs on a GPU:
a step returns the previous step's outputs at once and the "device" stays busy for the step's
time, which the next step waits out (sleeping, as a CUDA event's synchronize does, without the
GIL). The host's work between steps is then hidden while it takes less than a step.

A step's time, by one of two models (`DeviceStep`):
- constant: every step takes `full_ms` whatever its batch (12 ms: qwen3-0.6b at batch 256 on an
  H100), the figure the -gpu cases of bench/publish.py have always used;
- batch: a decode step reads the weights once and each running request's K and V
  (bench/decode_step.py's bound), so its time is that of the bytes it reads: `full_ms` at
  FULL_BATCH requests, the weights' share of it at batch 0, linear between. The bytes are those of
  the one GPU run measured (bench/RESULTS.md, "On a GPU: ...": qwen3-0.6b at batch 256, context
  1,024 on an H200, 31.764 GB a step of which 1.192 GB the weights, 596M bf16 parameters), so each
  echo request stands for one of ~1,041 tokens of context whatever its own length. At batch 1 the
  model gives 0.50 ms of a 12 ms full step: a floor, since a real step of one request also pays
  its kernels' launches and the sampler, which do not shrink with the batch.

As a script, the worker of the source tree on PYTHONPATH with its echo engine paced:

    python bench/device_pace.py FULL_MS MODEL serve --model echo ...

Nothing of the tree is imported before this file's directory leaves sys.path, so the tree's own
`worker` is the one that runs (a worktree of an older commit, which has no copy of this file).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

FULL_BATCH = 256
WEIGHTS_SHARE = 1.192 / 31.764  # of the full step's bytes; the rest is FULL_BATCH contexts' K and V
MODELS = ("constant", "batch")


@dataclass(frozen=True)
class DeviceStep:
    """A GPU step's time: `full_ms` at FULL_BATCH, by `model` (MODELS) at other batches."""

    full_ms: float
    model: str = "constant"

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"device step model {self.model!r}: expected one of {', '.join(MODELS)}")

    def seconds(self, batch: int) -> float:
        if self.model == "constant":
            return self.full_ms / 1e3
        return self.full_ms / 1e3 * (WEIGHTS_SHARE + (1 - WEIGHTS_SHARE) * batch / FULL_BATCH)

    def name(self) -> str:
        return (
            f"{self.full_ms:g} ms steps"
            if self.model == "constant"
            else f"steps by batch, {self.full_ms:g} ms at {FULL_BATCH}"
        )

    def describe(self) -> str:
        if self.model == "constant":
            return f"every GPU step {self.full_ms:g} ms"
        return (
            f"a GPU step's time by its batch, {self.full_ms:g} ms at {FULL_BATCH} "
            f"({self.seconds(1) * 1e3:.2f} ms at 1: weights + each request's KV read)"
        )


def pace_like_a_device(engine_class, step: DeviceStep) -> None:
    """`engine_class.step` made to wait out the previous step's device time, then to keep the
    device busy for this step's (by the batch it returned outputs for)."""
    host_step = engine_class.step

    def device_step(self):
        free_at = getattr(self, "device_free_at", 0.0)
        now = time.monotonic()
        if free_at > now:
            time.sleep(free_at - now)
        outputs = host_step(self)
        self.device_free_at = time.monotonic() + step.seconds(len(outputs))
        return outputs

    engine_class.step = device_step


def main(argv: list[str]) -> int:
    full_ms, model, *serve = argv
    del sys.path[0]  # this directory: the tree on PYTHONPATH leads, its packages are the ones imported
    from worker import __main__ as worker_main
    from worker.engine.echo import EchoEngine

    pace_like_a_device(EchoEngine, DeviceStep(float(full_ms), model))
    return worker_main.main(serve)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
