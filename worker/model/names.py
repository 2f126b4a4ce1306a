"""What a worker's --model takes, known without torch: a preset's name, `echo` or a directory.
A name that is none of them is refused before the worker imports torch and the kernels (seconds)
and before it waits for Redis."""

from pathlib import Path

from worker.model.errors import CheckpointError

PRESET_NAMES = ("tiny", "tiny-moe", "small", "qwen3-0.6b")  # worker.model.presets.PRESETS' names
ECHO = "echo"  # the engine without a model (worker.engine.echo)


def check_model_named(name: str) -> None:
    """CheckpointError unless `name` is a preset, `echo` or a directory (whose files the load checks)."""
    if name == ECHO or name in PRESET_NAMES or Path(name).expanduser().is_dir():
        return
    raise CheckpointError(
        f"{name}: no such checkpoint directory, nor a preset ({', '.join(PRESET_NAMES)}), "
        f"nor {ECHO} (the engine without a model)"
    )
