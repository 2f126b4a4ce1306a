"""What the engine's tests share with their fixtures (conftest.py): the test checkpoints' shape,
how they are written, and engines over a loaded model."""

from pathlib import Path

import torch

from worker.engine import Engine, EngineSettings
from worker.model.presets import write_random_checkpoint
from worker.model.qwen_tokenizer import write_qwen3_tokenizer_files

VOCAB = 2048  # the random checkpoint's vocabulary size (conftest.py)

# The dense test model's shape; each of conftest.py's checkpoints changes what it needs.
DENSE = dict(
    vocab_size=VOCAB,
    max_position_embeddings=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    tie_word_embeddings=False,
    initializer_range=0.3,
    bos_token_id=None,
    eos_token_id=None,
)


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
