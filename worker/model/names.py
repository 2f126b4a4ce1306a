"""What a worker's --model takes, known without torch: a preset's name, `echo` or a directory.
A name that is none of them is refused before the worker imports torch and the kernels (seconds)
and before it waits for Redis."""

from pathlib import Path

from worker.model.errors import CheckpointError

# The presets' names, their one list (torch-free), in the order of worker.model.presets.PRESET_SPECS.
PRESET_NAMES = ("tiny", "tiny-moe", "small", "qwen3-0.6b")
ECHO = "echo"  # the engine without a model (worker.engine.echo)


def check_model_named(name: str) -> None:
    """CheckpointError unless `name` is a preset, `echo` or a directory (whose files the load checks)."""
    if name == ECHO or name in PRESET_NAMES or Path(name).expanduser().is_dir():
        return
    raise CheckpointError(f"{no_such_checkpoint(name)}, nor {ECHO} (the engine without a model)")


def no_such_checkpoint(name: str | Path) -> str:
    """What a name that is no checkpoint directory nor a preset is told (the engine's loaders
    take no `echo`: check_model_named adds it)."""
    return f"{name}: no such checkpoint directory, nor a preset ({', '.join(PRESET_NAMES)})"
