"""The model's hot path. Each op dispatches to Triton on CUDA tensors (or under
TRITON_INTERPRET=1) and to its plain-torch reference otherwise. On CPU, float32 decode
attention runs a numba-compiled kernel instead (kernels.cpu_decode_attention), as do the LM
head and the greedy argmax, which the model and the sampler call directly (kernels.cpu_*). The
sampler masks structured outputs' logits with apply_token_bitmask (numba on CPU as well). LoRA
adapters' updates (lora_shrink, then lora_expand) run on CPU as torch's grouped GEMM."""

from kernels.activation import silu_and_mul
from kernels.decode_attention import paged_decode_attention
from kernels.extend_attention import paged_extend_attention
from kernels.fused_moe import fused_moe
from kernels.kv_store import store_kv
from kernels.lora_expand import lora_expand
from kernels.lora_shrink import lora_shrink
from kernels.rms_norm import fused_add_rms_norm, rms_norm
from kernels.rope import qk_norm_rope, rope_cos_sin_cache
from kernels.token_bitmask import apply_token_bitmask

__all__ = [
    "apply_token_bitmask",
    "fused_add_rms_norm",
    "fused_moe",
    "lora_expand",
    "lora_shrink",
    "paged_decode_attention",
    "paged_extend_attention",
    "qk_norm_rope",
    "rms_norm",
    "rope_cos_sin_cache",
    "silu_and_mul",
    "store_kv",
]
