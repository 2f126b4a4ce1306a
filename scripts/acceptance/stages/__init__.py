"""One module per stage, each defining STAGE (a scripts.acceptance.step.Stage) and listed here in
the order a GPU session runs them. A new stage is a new module and its name in ORDER."""

from __future__ import annotations

import importlib

from scripts.acceptance.step import Stage

ORDER = ("kernels", "engine", "bench", "serve", "moe", "structured", "tp", "long_context", "fp8", "speculative", "lora")


def stages() -> dict[str, Stage]:
    return {name: importlib.import_module(f"{__name__}.{name}").STAGE for name in ORDER}
