"""The directory of what MILI writes once per machine and reuses: preset checkpoints, the tokenizer
files built from Qwen's BPE ranks."""

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("MILI_CACHE_DIR") or Path.home() / ".cache" / "mili")
