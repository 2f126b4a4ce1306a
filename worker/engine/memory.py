"""How many KV pages the pool gets.

An explicit `num_pages` wins. On CPU the pool takes `kv_cache_mib`. On CUDA it takes
`gpu_memory_utilization` of the memory free once the weights are loaded, less the peak of
the largest step's activations, which a profiling pass measures: a prefill of
`max_num_batched_tokens` tokens, with every sequence sampling through every sampling feature
(the sampler's temporaries are [sequences, vocab], as large as the model's at 0.6B). What
`gpu_memory_utilization` leaves over is the headroom for CUDA graphs, the allocator's
fragmentation, and memory outside PyTorch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from producer_client.schema import SamplingParams
from worker.engine.errors import KVCacheTooSmall
from worker.engine.kv_pool import KVCacheShape, allocate_kv_caches, pages_for
from worker.engine.request import Request
from worker.engine.runner import ModelRunner
from worker.engine.sampler import Sampler
from worker.engine.scheduler import ScheduledChunk
from worker.engine.settings import EngineSettings
from worker.model.qwen3 import Qwen3ForCausalLM

log = logging.getLogger(__name__)

# Every sampling feature at once, so the profiled step allocates what the costliest real one does.
PROFILE_PARAMS = SamplingParams(
    temperature=0.8,
    top_p=0.9,
    top_k=50,
    min_p=0.05,
    repetition_penalty=1.1,
    presence_penalty=0.5,
    frequency_penalty=0.5,
    logprobs=20,
    max_tokens=1,
)


def kv_budget_bytes(free_bytes: int, utilization: float, activation_peak_bytes: int) -> int:
    """The pool's bytes: `utilization` of the memory free after the weights, less the activations' peak."""
    return int(free_bytes * utilization) - activation_peak_bytes


def pages_in_budget(budget_bytes: int, bytes_per_page: int) -> int:
    pages = budget_bytes // bytes_per_page
    if pages < 1:
        raise KVCacheTooSmall(f"{budget_bytes} bytes of KV memory hold no page of {bytes_per_page} bytes")
    return pages


def kv_cache_pages(
    shape: KVCacheShape,
    device: torch.device,
    settings: EngineSettings,
    profile: Callable[[], int],
    draft_bytes_per_page: int = 0,
) -> int:
    """The pool's size in pages. `profile` measures the activations' peak in bytes; it runs
    only when the pool is sized from GPU memory. A page also holds `draft_bytes_per_page` of a
    speculative draft's KV (worker/engine/speculative/draft_model.py)."""
    page_bytes = shape.bytes_per_page + draft_bytes_per_page
    if settings.num_pages is not None:
        pages, source = settings.num_pages, "num_pages"
    elif device.type != "cuda":
        pages = pages_in_budget(settings.kv_cache_mib * 2**20, page_bytes)
        source = f"kv_cache_mib {settings.kv_cache_mib}"
    else:
        free = torch.cuda.mem_get_info(device)[0]
        peak = profile()
        pages = pages_in_budget(kv_budget_bytes(free, settings.gpu_memory_utilization, peak), page_bytes)
        source = (
            f"gpu_memory_utilization {settings.gpu_memory_utilization} of {free / 2**30:.2f} GiB free after "
            f"the weights, less an activation peak of {peak / 2**30:.2f} GiB"
        )
    log.info(
        "KV cache: %d pages x %d tokens = %d tokens (%.1f MiB, %s, %s), from %s",
        pages,
        shape.page_size,
        pages * shape.page_size,
        pages * page_bytes / 2**20,
        shape.dtype,
        device,
        source,
    )
    return pages


def profile_batch(settings: EngineSettings, vocab_size: int) -> tuple[list[Request], list[ScheduledChunk]]:
    """The largest step: max_num_batched_tokens prompt tokens over min(max_running, that)
    sequences as even as they split, each prefilled whole and sampling with PROFILE_PARAMS, at
    its last k + 1 tokens under speculative decoding (a verify step samples at every token).
    Sequence i owns the pages that follow sequence i-1's, from page 0. The requests: one per
    sampled row."""
    num_tokens = settings.max_num_batched_tokens
    num_seqs = min(settings.max_running, num_tokens)
    verified = settings.num_speculative_tokens if settings.speculative_method is not None else 0
    rows, chunks, next_page = [], [], 0
    for i in range(num_seqs):
        length = num_tokens // num_seqs + (i < num_tokens % num_seqs)
        req = Request(f"profile-{i}", [(i + t) % vocab_size for t in range(length)], PROFILE_PARAMS, 0, i, None, None)
        pages = pages_for(length, settings.page_size)
        req.pages = list(range(next_page, next_page + pages))
        next_page += pages
        draft = req.token_ids[length - min(verified, length - 1) :] if length > 1 else []
        chunks.append(ScheduledChunk(req, 0, length, True, draft))
        rows += [req] * (1 + len(draft))
    return rows, chunks


@torch.inference_mode()
def profile_activation_peak(
    model: Qwen3ForCausalLM,
    shape: KVCacheShape,
    settings: EngineSettings,
    vocab_size: int,
    device: torch.device,
) -> int:
    """Bytes the profile batch's step allocates at its peak beyond what was live before it (CUDA)."""
    requests, chunks = profile_batch(settings, vocab_size)
    caches = allocate_kv_caches(shape, sum(len(c.request.pages) for c in chunks), device)
    runner = ModelRunner(model, caches, settings.page_size, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    logits = runner.run(chunks)
    if logits is not None:  # rank 0 samples; the other ranks of a tensor-parallel group get no logits
        Sampler([])(logits, requests)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del caches, runner
    torch.cuda.empty_cache()  # what the pass cached must count as free for the pool
    log.info(
        "profiled the largest step (%d tokens over %d sequences, %d rows sampling): activations peak at %.0f MiB",
        settings.max_num_batched_tokens,
        len(chunks),
        len(requests),
        peak / 2**20,
    )
    return peak
