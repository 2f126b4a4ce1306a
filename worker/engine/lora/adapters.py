"""Which LoRA adapters a worker serves, and the handle its requests share for each one."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from worker.model.lora_adapter import CONFIG_FILE, AdapterError

# A name looked up in lora_dir is one directory below it: no separator, no leading dot (no `..`).
DIRECTORY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}")


@dataclass(eq=False)
class AdapterHandle:
    """One adapter as the engine tracks it: `slot` is the device slot it is installed in (None while
    it is not: its requests wait); `error` is why it could not be read, once it could not."""

    name: str
    path: Path
    slot: int | None = None
    error: AdapterError | None = None
    last_used: int = field(default=0)  # the engine step that last wanted it, for the slots' LRU


class AdapterSource:
    """The adapters named at start (lora_modules) and, on demand, any adapter directory of lora_dir
    by its name; named ones first."""

    def __init__(self, modules: dict[str, str], directory: str | None):
        self.modules = {name: Path(path).expanduser() for name, path in modules.items()}
        self.directory = Path(directory).expanduser() if directory is not None else None

    def path_of(self, name: str) -> Path | None:
        if name in self.modules:
            return self.modules[name]
        if self.directory is None or not DIRECTORY_NAME.fullmatch(name):
            return None
        path = self.directory / name
        return path if (path / CONFIG_FILE).is_file() else None

    def names(self) -> list[str]:
        """Every name this worker serves now (lora_dir's as it stands)."""
        found = set(self.modules)
        if self.directory is not None and self.directory.is_dir():
            found.update(
                p.name
                for p in self.directory.iterdir()
                if DIRECTORY_NAME.fullmatch(p.name) and (p / CONFIG_FILE).is_file()
            )
        return sorted(found)
