"""Qwen3 decoder over a flattened varlen batch and a paged KV cache.

Numerics follow transformers' Qwen3ForCausalLM: pre-norm blocks, per-head q/k RMSNorm before
neox RoPE (plain or YaRN-scaled: worker/model/rope.py), GQA attention scaled by head_dim**-0.5,
SwiGLU MLP. Every hot-path op goes through `kernels`, which picks Triton or the torch reference.
Weights are allocated uninitialized and filled by `worker.model.loader`; q/k/v and gate/up are
fused into one projection each.
A Qwen3-MoE config (Qwen3MoeConfig) swaps the MLP of its sparse layers for a mixture of
experts (worker/model/moe.py); everything else is shared.

Under tensor parallelism (worker/model/parallel.py) each rank builds the same model over its
share of the heads, the intermediate rows and the vocabulary; the norms, the router and the
residual stream are whole on every rank.
"""

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.cpu_linear import FEW_ROWS as KERNEL_FEW_ROWS
from kernels.cpu_linear import linear_cpu
from kernels.cpu_linear import supports as cpu_linear_supports
from worker.model.batch import AttentionMetadata, KVCaches, LoraBatch
from worker.model.config import Qwen3Config
from worker.model.moe import Qwen3MoeSparseBlock
from worker.model.parallel import SINGLE, TensorParallel
from worker.model.params import empty_weight
from worker.model.rope import rope_table

# Up to this many rows, a float32 projection on CPU runs on the LM head's kernel: BLAS packs the
# weight on every call, which for a few rows costs more than the arithmetic (at 5 rows, a
# speculative verify step at batch 1, the packed product took 2.6x one row's time; the kernel,
# which reads the weight in place, half of it: bench/RESULTS.md, speculative decoding). The
# kernel's own few-row bound, where a row's output is the same bits whatever the rows beside it.
FEW_ROWS = KERNEL_FEW_ROWS


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = empty_weight(out_features, in_features, dtype=dtype)
        self.lora: nn.Module | None = None  # its LoRA adapters' slots (worker/model/lora.py), when served

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= FEW_ROWS and cpu_linear_supports(x, self.weight):
            out = linear_cpu(x, self.weight)
        else:
            out = F.linear(x, self.weight)
        if lora is not None and self.lora is not None:
            self.lora.add_update(out, x, lora)
        return out


class VocabParallelEmbedding(nn.Module):
    """The rows of this rank's share of the vocabulary (all of it on one rank); a token held
    elsewhere embeds as zeros here, and the all-reduce adds the one rank's real row to them."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, tp: TensorParallel):
        super().__init__()
        self.weight = empty_weight(tp.vocab_rows(vocab_size), dim, dtype=dtype)
        self.ids = tp.vocab(vocab_size)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.ids.start
        elsewhere = (local < 0) | (local >= len(self.ids))
        rows = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill_(elsewhere[:, None], 0))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = empty_weight(size, dtype=dtype)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without a residual: norm(x). With one: (norm(x + residual), x + residual)."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Qwen3Attention(nn.Module):
    def __init__(self, config: Qwen3Config, dtype: torch.dtype, tp: TensorParallel):
        super().__init__()
        self.num_heads = len(tp.split(config.num_attention_heads))
        self.num_kv_heads = len(tp.kv_heads(config.num_key_value_heads))
        self.head_dim = config.head_dim
        self.tp = tp
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, dtype)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        # A float8 KV cache's scales, one per kv head (worker/model/kv_scales.py sets them);
        # the kernels read them only for a float8 cache.
        self.register_buffer("k_scale", torch.ones(self.num_kv_heads), persistent=False)
        self.register_buffer("v_scale", torch.ones(self.num_kv_heads), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin: torch.Tensor,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden, lora).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = kernels.qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, positions, cos_sin, self.q_norm.eps)
        k_cache, v_cache = kv_cache
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        if meta.is_decode:
            out = kernels.paged_decode_attention(
                q, k_cache, v_cache, meta.page_table, meta.seq_lens, self.scale, self.k_scale, self.v_scale
            )
        else:
            out = kernels.paged_extend_attention(
                q,
                k_cache,
                v_cache,
                meta.page_table,
                meta.cu_seqlens_q,
                meta.prefix_lens,
                self.scale,
                meta.max_q_len,
                self.k_scale,
                self.v_scale,
            )
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size), lora))


class Qwen3MLP(nn.Module):
    def __init__(self, config: Qwen3Config, dtype: torch.dtype, tp: TensorParallel):
        super().__init__()
        inter = len(tp.split(config.intermediate_size))
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, dtype)
        self.down_proj = Linear(inter, config.hidden_size, dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x, lora)), lora))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, dtype: torch.dtype, layer: int, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Qwen3Attention(config, dtype, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        mlp = Qwen3MoeSparseBlock if config.is_moe_layer(layer) else Qwen3MLP
        self.mlp = mlp(config, dtype, tp)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin: torch.Tensor,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (block output, residual stream before it); the next norm adds the two.

        Deferring each residual add into the following fused add+norm computes the same sums
        as transformers' `residual + hidden` in the same order, so fp32 results match it.
        """
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta, kv_cache, cos_sin, lora)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, lora), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config, dtype: torch.dtype, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, dtype, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # fp32 whatever the weights' dtype, like transformers' rotary embedding; not a checkpoint tensor.
        cos_sin = rope_table(config.head_dim, config.rope_theta, config.context_length, config.rope_scaling)
        self.register_buffer("cos_sin", cos_sin, persistent=False)
        # An EAGLE-3 head reads the residual stream at the input of these layers (len(layers): the
        # last one's output), concatenated in this order: `captured` after each forward.
        self.capture_inputs: tuple[int, ...] = ()
        self.captured: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: KVCaches,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        states = {}
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i in self.capture_inputs:
                states[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual, meta, kv_cache, self.cos_sin, lora)
        hidden, stream = self.norm(hidden, residual)
        if self.capture_inputs:
            states[len(self.layers)] = stream
            self.captured = torch.cat([states[i] for i in self.capture_inputs], dim=-1)
        return hidden


class Qwen3ForCausalLM(nn.Module):
    """Build under `with torch.device(...)` and load weights with `worker.model.loader.load_model`.

    Create it in its final dtype rather than calling `.to(dtype)` afterwards, which would also
    cast the fp32 RoPE table. `tp`: this rank's share of a tensor-parallel group.
    """

    def __init__(self, config: Qwen3Config, dtype: torch.dtype = torch.float32, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = Qwen3Model(config, dtype, tp)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, tp.vocab_rows(config.vocab_size), dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: KVCaches,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden_size]. `lora`: the rows
        that use a LoRA adapter, and which (worker/model/lora.py)."""
        return self.model(input_ids, positions, meta, kv_caches, lora)

    def warm_up_experts(self, max_tokens: int) -> None:
        """A mixture of experts runs each kernel tile shape a step of up to max_tokens tokens can
        launch (Qwen3MoeSparseBlock.warm_up), in one layer: they all share their shapes."""
        sparse = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, Qwen3MoeSparseBlock)]
        if sparse:
            sparse[0].warm_up(max_tokens)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """hidden [N, hidden_size] -> logits [N, vocab] in float32, written into `out` when given.
        Under tensor parallelism rank 0 gathers every rank's columns, and the others get None."""
        head = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        if self.tp.size == 1:
            return project_logits(hidden, head, out)
        return self.tp.gather_vocab(project_logits(hidden, head), self.config.vocab_size, out)


def project_logits(hidden: torch.Tensor, head: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    if cpu_linear_supports(hidden, head):
        return linear_cpu(hidden, head, out)
    if hidden.device.type == "cpu":
        return lm_head_in_vocab_chunks(hidden, head, out)
    logits = F.linear(hidden, head)
    return logits.float() if out is None else out.copy_(logits)  # the copy converts: no float32 temporary


# On CPU one [N, H] x [H, vocab] product with Qwen3's 151,936-token vocabulary runs well below
# the layers' GFLOP/s; in slices of the vocabulary (each [N, 4096] output block small enough to
# stay in cache) it ran faster for N in 8..64, with the same values.
# float32 has its own kernel (kernels.cpu_linear); this serves 16-bit weights.
LM_HEAD_CHUNK = 4096


def lm_head_in_vocab_chunks(hidden: torch.Tensor, head: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    logits = out if out is not None else torch.empty(hidden.shape[0], head.shape[0], dtype=torch.float32)
    for start in range(0, head.shape[0], LM_HEAD_CHUNK):
        logits[:, start : start + LM_HEAD_CHUNK] = F.linear(hidden, head[start : start + LM_HEAD_CHUNK])
    return logits
