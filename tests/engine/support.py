"""What the engine's tests share with their fixtures (conftest.py): the test checkpoints' shape,
how they are written, and engines over a loaded model."""

from pathlib import Path

import torch

from harness.model_configs import SMALL_DENSE
from worker.engine import Engine, EngineSettings
from worker.model.presets import write_random_checkpoint
from worker.model.qwen_tokenizer import write_qwen3_tokenizer_files

VOCAB = SMALL_DENSE["vocab_size"]  # the random checkpoint's vocabulary size (conftest.py)


def write_test_checkpoint(directory: Path, config: dict, seed: int) -> Path:
    ckpt = write_random_checkpoint(directory, config, seed=seed, norm_std=0.1)
    write_qwen3_tokenizer_files(ckpt)
    return ckpt


def engine_maker(loaded):
    """Engines share the (stateless) model and tokenizer; each gets its own KV pool."""
    (model, config, _), tokenizer = loaded

    def make(eos_token_ids=(), **settings) -> Engine:
        settings = {"num_pages": 256, "page_size": 4, **settings}
        return Engine(
            model, config, tokenizer, EngineSettings.parse(**settings), list(eos_token_ids), torch.device("cpu")
        )

    return make
