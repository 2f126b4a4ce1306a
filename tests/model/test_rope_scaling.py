"""YaRN: read from config.json in each of its spellings, tabled exactly as transformers computes
it, and the model equal to transformers' past the original window (on CUDA where there is one:
the GPU acceptance's long_context stage runs these there)."""

import json

import pytest
import torch

from harness.model_configs import SMALL_DENSE
from harness.paged_model import PagedModelRunner
from kernels.rope import rope_cos_sin_cache
from producer_client.errors import InvalidArgument
from tests.model.test_parity import assert_logits_close
from worker.engine.rank_setup import resolve_max_model_len
from worker.engine.settings import EngineSettings
from worker.model.config import CheckpointError, Qwen3Config
from worker.model.loader import load_model
from worker.model.presets import qwen3_config, write_random_checkpoint
from worker.model.rope import YarnScaling, rope_table

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}  # Qwen3's model card


def config_with(**fields) -> Qwen3Config:
    return Qwen3Config.model_validate(
        qwen3_config(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            **fields,
        )
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"rope_scaling": QWEN3_YARN},
        {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
        {"rope_scaling": None, "rope_parameters": {**QWEN3_YARN, "rope_theta": 1e6}},
    ],
    ids=["model-card", "legacy-type-key", "transformers5"],
)
def test_yarn_is_read_from_every_spelling_and_sets_the_context(fields):
    config = config_with(**fields)
    assert config.rope_scaling == YarnScaling(**QWEN3_YARN)
    assert config.rope_theta == 1e6
    assert config.context_length == 131072
    assert resolve_max_model_len(EngineSettings(), config) == 131072


def test_yarn_defaults_follow_transformers():
    # No original window: max_position_embeddings; no factor: the ratio of the two.
    config = config_with(max_position_embeddings=40960, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    assert config.rope_scaling.original_max_position_embeddings == 40960
    assert config.context_length == 81920
    config = config_with(
        max_position_embeddings=65536, rope_scaling={"rope_type": "yarn", "original_max_position_embeddings": 16384}
    )
    assert config.rope_scaling.factor == 4.0


def test_plain_rope_keeps_max_position_embeddings_and_refuses_more():
    config = config_with(max_position_embeddings=40960)
    assert config.rope_scaling is None
    assert resolve_max_model_len(EngineSettings(), config) == 40960
    with pytest.raises(InvalidArgument, match="max_model_len: 40961 exceeds the model's context of 40960"):
        resolve_max_model_len(EngineSettings(max_model_len=40961), config)


def test_yarn_with_a_bad_factor_names_the_field(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            qwen3_config(
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=1,
                num_attention_heads=2,
                rope_scaling={**QWEN3_YARN, "factor": 0.5},
            )
        )
    )
    with pytest.raises(
        CheckpointError, match=r"config\.json: rope_scaling\.factor: Input should be greater than or equal to 1"
    ):
        Qwen3Config.from_file(path)


@pytest.mark.parametrize(
    "head_dim, theta, yarn",
    [
        (128, 1e6, QWEN3_YARN),
        (64, 1e6, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
        (
            64,
            1e4,
            {
                "rope_type": "yarn",
                "factor": 2.5,
                "original_max_position_embeddings": 128,
                "beta_fast": 16,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
            },
        ),
        (
            32,
            1e6,
            {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 256,
                "attention_factor": 1.3,
                "truncate": False,
            },
        ),
    ],
)
def test_yarn_table_is_transformers_rotary_embedding_bit_for_bit(head_dim, theta, yarn):
    from transformers import Qwen3Config as HFQwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    # Qwen3's own case covers every position up to 131,072: 40K, past its 32K window, included.
    context = int(yarn["original_max_position_embeddings"] * yarn["factor"])
    hf = Qwen3RotaryEmbedding(
        HFQwen3Config(head_dim=head_dim, rope_theta=theta, max_position_embeddings=context, rope_scaling=yarn)
    )
    cos, sin = hf(torch.zeros(1), torch.arange(context)[None])
    table = rope_table(head_dim, theta, context, YarnScaling(**yarn))
    half = head_dim // 2
    assert torch.equal(table[:, :half], cos[0, :, :half])
    assert torch.equal(table[:, half:], sin[0, :, :half])


@pytest.fixture(scope="module")
def yarn_models(tmp_path_factory):
    """A random Qwen3 trained, as it were, on 64 positions, scaled 4x by YaRN to 256."""
    from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM

    config = qwen3_config(
        **SMALL_DENSE
        | dict(
            max_position_embeddings=256,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        )
    )
    ckpt = write_random_checkpoint(tmp_path_factory.mktemp("yarn"), config, seed=9, norm_std=0.1)
    ours = load_model(ckpt, dtype=torch.float32, device=DEVICE).model
    ref = HFQwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(DEVICE).eval()
    assert ref.model.rotary_emb.rope_type == "yarn"
    assert (ours.model.cos_sin.cpu() - rope_cos_sin_cache(32, 256, 1e6)).abs().max() > 0.1  # the scaling is in effect
    return ours, ref


@pytest.mark.cuda
@torch.inference_mode()
def test_yarn_model_matches_transformers_past_the_original_window(yarn_models):
    ours, ref = yarn_models
    prompt = torch.randint(0, 2048, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    runner = PagedModelRunner(ours)
    seq = runner.add_sequence()
    logits = torch.cat([runner.extend({seq: prompt[i : i + 50]})[0] for i in range(0, 200, 50)])
    assert_logits_close(logits, ref(torch.tensor([prompt], device=DEVICE)).logits[0])

    generated = [logits[-1].argmax().item()]
    for _ in range(48):  # to position 248 of 256
        generated.append(runner.decode({seq: generated[-1]})[0].argmax().item())
    expected = ref.generate(
        torch.tensor([prompt], device=DEVICE),
        attention_mask=torch.ones(1, 200, dtype=torch.long, device=DEVICE),
        max_new_tokens=49,
        do_sample=False,
        pad_token_id=0,
    )[0, 200:].tolist()
    assert generated == expected
    assert len(set(generated)) > 16
