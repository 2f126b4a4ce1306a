from pathlib import Path

import pytest

from worker.model.qwen_tokenizer import write_qwen3_tokenizer_files


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory) -> Path:
    """Qwen3's tokenizer files, written once per session (building tokenizer.json takes ~2 s)."""
    out_dir = tmp_path_factory.mktemp("qwen3_tokenizer")
    write_qwen3_tokenizer_files(out_dir)
    return out_dir
