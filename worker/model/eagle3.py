"""An EAGLE-3 head (Li et al. 2025): one Llama decoder layer that drafts from the target's hidden
states, in the math of EAGLE's and SpecForge's `LlamaForCausalLMEagle3` (and vLLM's and SGLang's
Eagle3 Llama models).

At position p the head reads the target's token after it, x_{p+1}, and a feature of position p:
`fc` over the target's hidden states at three layers (low, middle, high; worker/model/qwen3.py
captures them) at the first step, its own previous output at the next ones. The layer normalizes
the embedding (input_layernorm) and the feature (hidden_norm), concatenates them ([embedding;
feature], 2 * hidden wide, what q/k/v project from), attends with RoPE (no q/k norm) over its own
paged KV, then adds the residual (the feature, or its norm with `norm_before_residual`) and runs a
SwiGLU MLP. The sum before the final norm is the next step's feature; after the norm, `lm_head`
scores the head's own vocabulary, whose id d is the target's d + d2t[d].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from worker.model.batch import AttentionMetadata
from worker.model.eagle3_config import Eagle3Config
from worker.model.params import empty_weight
from worker.model.qwen3 import Linear, RMSNorm
from worker.model.rope import rope_table


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(2 * config.hidden_size, self.q_size + 2 * self.kv_size, dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, dtype)
        table = rope_table(config.head_dim, config.rope_theta, config.max_position_embeddings, None)
        self.register_buffer("cos_sin", table, persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)
        q = rotate(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = rotate(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode:
            out = kernels.paged_decode_attention(q, k_cache, v_cache, meta.page_table, meta.seq_lens, self.scale)
        else:
            out = kernels.paged_extend_attention(
                q, k_cache, v_cache, meta.page_table, meta.cu_seqlens_q, meta.prefix_lens, self.scale, meta.max_q_len
            )
        return self.o_proj(out.reshape(-1, self.q_size))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-layout RoPE of x [T, H, D] by the positions' cos, sin [T, D / 2]."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Eagle3Layer(nn.Module):
    def __init__(self, config: Eagle3Config, dtype: torch.dtype):
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.hidden_norm = RMSNorm(hidden, eps, dtype)
        self.self_attn = Eagle3Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.gate_up_proj = Linear(hidden, 2 * config.intermediate_size, dtype)
        self.down_proj = Linear(config.intermediate_size, hidden, dtype)
        self.norm_before_residual = config.norm_before_residual

    def forward(
        self,
        embeds: torch.Tensor,
        feature: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """The layer's output before the final norm: the next step's feature."""
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        attended = self.self_attn(x, positions, meta, kv_cache)
        hidden, residual = self.post_attention_layernorm(attended, residual)
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(hidden))) + residual


class Eagle3Head(nn.Module):
    """Build under `with torch.device(...)`; worker.model.eagle3_checkpoint fills the weights.
    `embed_tokens`: the head's own embedding, or the target's it shares."""

    def __init__(self, config: Eagle3Config, dtype: torch.dtype, embed_tokens: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        if embed_tokens is None:
            self.embed_tokens = empty_weight(config.vocab_size, config.hidden_size, dtype=dtype)
        else:
            self.register_buffer("embed_tokens", embed_tokens, persistent=False)
        self.fc = Linear(3 * config.target_hidden_size, config.hidden_size, dtype)
        self.midlayer = Eagle3Layer(config, dtype)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = Linear(config.hidden_size, config.draft_vocab_size, dtype)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))

    def features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[T, 3 * target hidden] (the target's three layers, concatenated) -> [T, hidden]."""
        return self.fc(target_hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        feature: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        return self.midlayer(F.embedding(input_ids, self.embed_tokens), feature, positions, meta, kv_cache)

    def greedy_tokens(self, output: torch.Tensor) -> torch.Tensor:
        """[N] the target ids of the head's most likely token after each output row."""
        draft_ids = self.lm_head(self.norm(output)).argmax(dim=-1)
        return draft_ids + self.d2t[draft_ids]
