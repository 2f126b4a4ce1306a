"""The EAGLE-3 proposer: random heads written in the published layouts (EAGLE/SpecForge's and
speculators') load, draft exactly what the published head math drafts from the target's hidden
states, and change no output.

The reference below is written from the math of SpecForge's LlamaForCausalLMEagle3 (the trainer of
the Qwen3 heads), dense and without our kernels: fc over the target's three layers, the layer over
[input_layernorm(embedding); hidden_norm(feature)] with RoPE and causal attention, residual, MLP,
the final norm, lm_head, d2t. The engine's drafts must equal its greedy chain at every proposal,
which also shows that the head's paged KV holds the right positions after rejected drafts."""

import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from harness.model_configs import SMALL_DENSE
from producer_client.errors import InvalidArgument
from producer_client.schema import SamplingParams
from tests.engine.speculative_support import always_speculating
from tests.engine.test_engine import assert_all_pages_free_after_clear, random_prompts
from tests.engine.test_speculative import assert_same_outputs
from worker.engine.kv_pool import pages_for
from worker.engine.verify_graphs import VerifyGraphRunner
from worker.model.config import CheckpointError
from worker.model.eagle3_checkpoint import load_eagle3_head, write_random_eagle3_head
from worker.model.eagle3_config import read_eagle3_config
from worker.model.presets import qwen3_config

PROMPTS = random_prompts(4, 3, 30, seed=41)
AUX_IDS = {"eagle": [0, 0, 1], "speculators": [1, 1, 2]}  # both: the inputs of layers 1, 1 and 2 (the output)


@pytest.fixture(scope="module", params=["eagle", "speculators"])
def head(request, tmp_path_factory):
    layout = request.param
    path = tmp_path_factory.mktemp(f"eagle3-{layout}")
    return write_random_eagle3_head(
        path, qwen3_config(**SMALL_DENSE), layout, 700, seed=4, aux_layer_ids=AUX_IDS[layout]
    )


def eagle_engine(make_engine, head, **settings):
    engine = make_engine(speculative_method="eagle3", speculative_model=str(head), num_speculative_tokens=3, **settings)
    return always_speculating(engine)


def test_a_published_layout_reads_the_aux_layers_in_its_own_convention(head):
    config = read_eagle3_config(head)
    assert config.aux_layer_inputs(2) == (1, 1, 2)
    assert config.norm_before_residual == ("layers.0.hidden_norm.weight" in load_file(head / "model.safetensors"))


@pytest.mark.parametrize(
    "settings",
    [{}, {"num_pages": 24}, {"kv_cache_dtype": "fp8_e4m3", "overlap_schedule": True}],
    ids=["roomy", "preemption", "fp8-kv-overlapped"],
)
def test_greedy_and_seeded_outputs_equal_the_engine_without_speculation(make_engine, head, settings):
    params = [SamplingParams(temperature=0, max_tokens=20), SamplingParams(temperature=0.9, seed=2, max_tokens=20)] * 2
    want = make_engine(**settings).generate(PROMPTS, params)
    engine = eagle_engine(make_engine, head, **settings)
    assert_same_outputs(engine.generate(PROMPTS, params), want)
    assert engine.stats().draft_tokens > 0
    assert_all_pages_free_after_clear(engine)


def test_the_head_drafts_what_the_published_math_drafts(make_engine, head, hf_model):
    engine = eagle_engine(make_engine, head)
    proposals = record_proposals(engine)
    engine.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12))
    assert len(proposals) >= 6
    weights, config = head_tensors(head), read_eagle3_config(head)
    for tokens, draft in proposals:
        assert draft == reference_drafts(hf_model, weights, config, tokens, len(draft))


def test_replayed_verify_steps_give_the_head_the_same_states(make_engine, head):
    """Padded for a graph, a verify step's captured states come back in the step's own row order."""
    eager = eagle_engine(make_engine, head)
    eager_proposals = record_proposals(eager)
    params = SamplingParams(temperature=0, max_tokens=12)
    want = eager.generate(PROMPTS, params)
    padded = eagle_engine(make_engine, head)
    padded.runner.verify_graphs = VerifyGraphRunner(
        padded.runner.model, padded.runner.kv_caches, 4, pages_for(padded.max_model_len + 4, 4), 4, torch.device("cpu")
    )
    proposals = record_proposals(padded)
    assert_same_outputs(padded.generate(PROMPTS, params), want)
    assert proposals == eager_proposals


def test_the_captured_states_are_the_targets_layer_inputs(make_engine, head, hf_model):
    engine = eagle_engine(make_engine, head)
    engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1))  # the prefill alone
    captured = engine.runner.model.model.captured
    with torch.inference_mode():
        states = hf_model(torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states
    stream_out = residual_stream_output(hf_model, PROMPTS[0])
    want = torch.cat([states[1][0], states[1][0], stream_out], dim=-1)
    torch.testing.assert_close(captured, want, rtol=1e-4, atol=1e-4)


def test_a_head_of_another_vocabulary_or_hidden_size_is_refused(make_engine, tmp_path):
    other_vocab = write_random_eagle3_head(tmp_path / "vocab", qwen3_config(**{**SMALL_DENSE, "vocab_size": 1000}))
    with pytest.raises(InvalidArgument, match="vocabulary"):
        eagle_engine(make_engine, other_vocab)
    narrower = qwen3_config(**{**SMALL_DENSE, "hidden_size": 32})
    with pytest.raises(InvalidArgument, match="hidden states of size 32"):
        eagle_engine(make_engine, write_random_eagle3_head(tmp_path / "hidden", narrower, aux_layer_ids=[0, 0, 1]))


def test_a_head_without_an_embedding_needs_the_models_whole(head):
    # As under tensor parallelism, where rank 0 holds a share of the model's embedding only.
    with pytest.raises(CheckpointError, match="split across tensor-parallel ranks"):
        load_eagle3_head(head, torch.float32, torch.device("cpu"), None)


def test_a_head_missing_a_tensor_is_refused_naming_it(make_engine, head, tmp_path):
    from safetensors.torch import save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((head / "config.json").read_text())
    tensors = {k: v for k, v in load_file(head / "model.safetensors").items() if not k.endswith("o_proj.weight")}
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match="self_attn.o_proj"):
        eagle_engine(make_engine, broken)


# -- the reference -----------------------------------------------------------------------------


def record_proposals(engine) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens, its draft) of every non-empty draft the engine's proposer makes."""
    proposals = []
    propose = engine.speculator.proposer.propose

    def recording(requests, limits):
        drafts = propose(requests, limits)
        proposals.extend((list(r.token_ids), d) for r, d in zip(requests, drafts) if d)
        return drafts

    engine.speculator.proposer.propose = recording
    return proposals


def head_tensors(path) -> dict[str, torch.Tensor]:
    tensors = load_file(path / "model.safetensors")
    return {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}


def residual_stream_output(hf_model, tokens: list[int]) -> torch.Tensor:
    """The last decoder layer's output (before the final norm), which transformers does not return."""
    captured = {}
    hook = hf_model.model.norm.register_forward_hook(lambda module, args, out: captured.update(stream=args[0]))
    try:
        with torch.inference_mode():
            hf_model(torch.tensor([tokens]))
    finally:
        hook.remove()
    return captured["stream"][0]


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotate_half RoPE of x [T, heads, D]."""
    d = x.shape[-1]
    freqs = torch.outer(positions.float(), 1.0 / theta ** (torch.arange(0, d, 2).float() / d))
    cos, sin = torch.cat([freqs.cos()] * 2, -1)[:, None], torch.cat([freqs.sin()] * 2, -1)[:, None]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


def reference_layer(w, config, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    eps, d = config.rms_norm_eps, config.head_dim
    normed = rms(features, w["midlayer.hidden_norm.weight"], eps)
    residual = normed if config.norm_before_residual else features
    x = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"], eps), normed], dim=-1)
    positions = torch.arange(x.shape[0])
    q = rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(x.shape[0], -1, d), positions, config.rope_theta)
    k = rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(x.shape[0], -1, d), positions, config.rope_theta)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(x.shape[0], -1, d)
    attended = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=1 / math.sqrt(d), enable_gqa=True
    )
    h = residual + attended.transpose(0, 1).reshape(x.shape[0], -1) @ w["midlayer.self_attn.o_proj.weight"].T
    post = rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = post @ w["midlayer.mlp.gate_proj.weight"].T, post @ w["midlayer.mlp.up_proj.weight"].T
    return h + (F.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T


def reference_drafts(hf_model, w, config, tokens: list[int], n: int) -> list[int]:
    """The head's greedy chain after `tokens`: positions 0..len-2 read the target's states and the
    token after each; each drafted token then extends the sequence with the previous output."""
    context = tokens[:-1]
    with torch.inference_mode():
        states = hf_model(torch.tensor([context]), output_hidden_states=True).hidden_states
        layers = torch.cat([states[1][0], states[1][0], residual_stream_output(hf_model, context)], dim=-1)
        embedding = hf_model.model.embed_tokens.weight
        features = layers @ w["fc.weight"].T
        inputs = list(tokens[1:])
        drafts = []
        for _ in range(n):
            out = reference_layer(w, config, embedding[torch.tensor(inputs)], features)
            logits = rms(out[-1], w["norm.weight"], config.rms_norm_eps) @ w["lm_head.weight"].T
            draft_id = int(logits.argmax())
            drafts.append(draft_id + int(w["d2t"][draft_id]))
            features = torch.cat([features, out[-1:]])
            inputs.append(drafts[-1])
    return drafts
