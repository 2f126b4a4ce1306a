"""Small random Qwen3 and Qwen3-MoE checkpoints (with Qwen3's tokenizer) and engines over them.

Weights are drawn with std 0.3 and an untied head so greedy outputs vary from token to token
(the default 0.02 makes a random model repeat its last token, which would prove little). The
MoE checkpoint routes each token to 3 of 6 experts (not renormalized) in its first and last
layers, and keeps a dense MLP in the middle one (mlp_only_layers).
"""

from pathlib import Path

import pytest
import torch

from harness.model_configs import SMALL_DENSE
from tests.engine.support import VOCAB, engine_maker, write_test_checkpoint
from worker.engine import Engine, EngineSettings
from worker.model.loader import load_model
from worker.model.presets import qwen3_config, qwen3_moe_config, resolve_model_path
from worker.model.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return write_test_checkpoint(tmp_path_factory.mktemp("engine_ckpt"), qwen3_config(**SMALL_DENSE), seed=3)


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory) -> Path:
    config = qwen3_moe_config(
        **{
            **SMALL_DENSE,
            "moe_intermediate_size": 32,
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "norm_topk_prob": False,
            "mlp_only_layers": [1],
            "num_hidden_layers": 3,
        }
    )
    return write_test_checkpoint(tmp_path_factory.mktemp("moe_engine_ckpt"), config, seed=5)


@pytest.fixture(scope="session")
def replicated_kv_checkpoint(tmp_path_factory) -> Path:
    """One KV head for 4 query heads (each rank holds a copy), and an odd vocabulary (the last
    rank's share of the embedding and the head ends in a padding row)."""
    config = qwen3_config(**{**SMALL_DENSE, "vocab_size": VOCAB - 1, "num_key_value_heads": 1})
    return write_test_checkpoint(tmp_path_factory.mktemp("kv1_ckpt"), config, seed=7)


@pytest.fixture(scope="session")
def models(checkpoint, moe_checkpoint, replicated_kv_checkpoint) -> dict[str, Path]:
    """The checkpoints the tensor-parallel tests split: KV heads split over 2 ranks (tiny's and
    kv-split's), replicated, and a mixture of experts."""
    return {
        "tiny": resolve_model_path("tiny"),
        "kv-split": checkpoint,
        "kv-replicated": replicated_kv_checkpoint,
        "moe": moe_checkpoint,
    }


@pytest.fixture(scope="session")
def loaded(checkpoint):
    return load_model(checkpoint, dtype=torch.float32), Tokenizer.from_dir(checkpoint)


@pytest.fixture(scope="session")
def moe_loaded(moe_checkpoint):
    return load_model(moe_checkpoint, dtype=torch.float32), Tokenizer.from_dir(moe_checkpoint)


@pytest.fixture(scope="session")
def make_engine(loaded):
    return engine_maker(loaded)


@pytest.fixture(scope="session")
def make_moe_engine(moe_loaded):
    return engine_maker(moe_loaded)


@pytest.fixture(scope="session")
def hf_model(checkpoint):
    # Imported here: transformers' model classes take seconds to import, and most engine tests
    # (and the GPU stages' pytest steps that run a few of them) never compare with transformers.
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    @torch.inference_mode()
    def greedy(prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
        ids = torch.tensor([prompt])
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
        return out[0, len(prompt) :].tolist()

    return greedy


@pytest.fixture(scope="session")
def tiny_loaded():
    """The `tiny` preset: Qwen3's whole vocabulary, which structured outputs need (a grammar may
    allow only a merged token, such as `{"`, that a test model's short vocabulary lacks)."""
    path = resolve_model_path("tiny")
    return load_model(path, dtype=torch.float32), Tokenizer.from_dir(path)


@pytest.fixture(scope="session")
def make_tiny_engine(tiny_loaded):
    (model, config, generation), tokenizer = tiny_loaded
    eos = list(generation.eos_token_ids) + list(tokenizer.eos_token_ids)

    def make(**settings) -> Engine:
        settings = {"num_pages": 256, "page_size": 4, **settings}
        return Engine(model, config, tokenizer, EngineSettings.parse(**settings), eos, torch.device("cpu"))

    return make
