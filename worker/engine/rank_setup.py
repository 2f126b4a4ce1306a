"""What every rank builds around its model before serving, in one order on every rank: under
tensor parallelism these steps hold collectives (the profiled step's forward, the agreement on
the pool's size, the captured graphs' forwards), which must line up across the ranks.

The pool's page count is the least any rank can hold, so that rank 0's page decisions (the
scheduler's page tables) fit every rank's pool of its own heads.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from producer_client.errors import InvalidArgument
from worker.engine.cuda_graph import DecodeGraphRunner
from worker.engine.kv_pool import KVCacheShape, allocate_kv_caches, kv_cache_dtype, pages_for
from worker.engine.memory import kv_cache_pages, profile_activation_peak
from worker.engine.settings import EngineSettings
from worker.engine.verify_graphs import VerifyGraphRunner
from worker.model.batch import KVCaches
from worker.model.config import Qwen3Config
from worker.model.kv_scales import use_fp8_kv_scales
from worker.model.qwen3 import Qwen3ForCausalLM

log = logging.getLogger(__name__)


def resolve_max_model_len(settings: EngineSettings, config: Qwen3Config) -> int:
    # Positions index the model's RoPE table, so the context cannot outgrow it.
    limit = config.context_length  # YaRN's scaled window where the config has one
    if settings.max_model_len is None:
        return limit
    if settings.max_model_len > limit:
        raise InvalidArgument("max_model_len", f"{settings.max_model_len} exceeds the model's context of {limit}")
    return settings.max_model_len


class RankMemory(NamedTuple):
    num_pages: int
    kv_caches: KVCaches
    decode_graphs: DecodeGraphRunner | None  # captured on CUDA when settings.cuda_graphs
    verify_graphs: VerifyGraphRunner | None  # the same, for speculative decoding's verify steps


def kv_cache_shape(
    model: Qwen3ForCausalLM,
    config: Qwen3Config,
    settings: EngineSettings,
    device: torch.device,
) -> KVCacheShape:
    """The KV cache of this rank's heads, in settings.kv_cache_dtype."""
    heads = len(model.tp.kv_heads(config.num_key_value_heads))
    dtype = kv_cache_dtype(settings.kv_cache_dtype, model.model.norm.weight.dtype, device)
    return KVCacheShape(config.num_hidden_layers, heads, config.head_dim, settings.page_size, dtype)


def use_fp8_cache(model: Qwen3ForCausalLM, shape: KVCacheShape) -> None:
    """Sets the scales of a float8 pool (each rank's from its own heads' weights) and says what it gains."""
    model_dtype = model.model.norm.weight.dtype
    use_fp8_kv_scales(model)
    log.info(
        "KV cache in %s with per-kv-head power-of-two scales from the weights: %.1fx the tokens of a %s "
        "cache in the same memory",
        shape.dtype,
        model_dtype.itemsize / shape.dtype.itemsize,
        model_dtype,
    )


def prepare_rank(
    model: Qwen3ForCausalLM,
    config: Qwen3Config,
    settings: EngineSettings,
    device: torch.device,
    max_model_len: int,
    draft_bytes_per_page: int = 0,
) -> RankMemory:
    """`draft_bytes_per_page`: what each page holds of a speculative draft's KV (rank 0's)."""
    shape = kv_cache_shape(model, config, settings, device)
    if shape.dtype != model.model.norm.weight.dtype:
        use_fp8_cache(model, shape)
    vocab = config.vocab_size
    pages = kv_cache_pages(
        shape,
        device,
        settings,
        lambda: profile_activation_peak(model, shape, settings, vocab, device),
        draft_bytes_per_page,
    )
    num_pages = model.tp.min(pages)
    if num_pages < pages:
        log.info("KV cache: %d pages, as many as every rank of the tensor-parallel group holds", num_pages)
    kv_caches = allocate_kv_caches(shape, num_pages, device)
    graphs = verify = None
    if settings.cuda_graphs and device.type == "cuda":
        # A page table row never needs more pages than max_model_len tokens fill, nor than the pool has.
        max_pages = min(pages_for(max_model_len, settings.page_size), num_pages)
        graphs = DecodeGraphRunner(model, kv_caches, settings.max_running, max_pages, device)
        graphs.capture()
        if settings.speculative_method is not None:
            q = settings.num_speculative_tokens + 1  # a verify step's padding reads up to q keys past a sequence
            verify_pages = pages_for(max_model_len + q, settings.page_size)
            verify = VerifyGraphRunner(model, kv_caches, settings.max_running, verify_pages, q, device)
            verify.capture()
    return RankMemory(num_pages, kv_caches, graphs, verify)
