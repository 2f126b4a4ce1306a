"""What the engine does once, as it starts: say its limits in the log, and run every kernel it
will use before a job has to wait for one to compile."""

from __future__ import annotations

import logging

import torch

from kernels.token_bitmask import apply_token_bitmask
from producer_client.schema import SamplingParams
from worker.engine.grammar.masks import GrammarMasks
from worker.engine.kv_pool import PageAllocator, pages_for
from worker.engine.page_table import PageTable
from worker.engine.request import Request
from worker.engine.runner import ModelRunner
from worker.engine.sampler import Sampler
from worker.engine.scheduler import ScheduledChunk
from worker.engine.settings import EngineSettings
from worker.engine.speculative.speculator import Speculator
from worker.model.lora import warm_up_lora

log = logging.getLogger(__name__)


def warm_up_kernels(
    runner: ModelRunner,
    sampler: Sampler,
    masks: GrammarMasks,
    allocator: PageAllocator,
    page_table: PageTable,
    settings: EngineSettings,
    speculator: Speculator | None,
) -> None:
    """Runs a two-token prompt and one decode step through the model and the sampler, on pages
    borrowed from the pool and outside the scheduler (Engine.warm_up says why this is enough), a
    speculative proposer's draft after them, then a mixture of experts' experts and the LoRA
    adapters' kernels (if the model serves any) at each size a step can pick."""
    req = Request("warm-up", [0, 1], SamplingParams(temperature=0, max_tokens=2), 0, 0, None, None)
    k = settings.num_speculative_tokens if speculator is not None else 0
    req.pages = allocator.allocate(pages_for(3 + k, settings.page_size))  # prompt, a decode, a draft
    try:
        for chunk in (ScheduledChunk(req, 0, 2, True), ScheduledChunk(req, 2, 1, True)):
            sampled = sampler(runner.run([chunk]), [req], lambda logits: allow_everything(logits, masks))
            req.token_ids.append(sampled.token_ids[0])
            req.num_computed_tokens += chunk.num_tokens
            if speculator is not None:
                speculator.observe([chunk])
        if speculator is not None:
            speculator.proposer.propose([req], [k])
    finally:
        allocator.decref(req.pages)
        page_table.release(req)
    runner.model.warm_up_experts(settings.max_num_batched_tokens)
    warm_up_lora(runner.model, settings.max_num_batched_tokens)


def allow_everything(logits: torch.Tensor, masks: GrammarMasks) -> None:
    """Masks with an all-allowing row: compiles the structured outputs' kernel, changes nothing."""
    rows = torch.zeros(1, dtype=torch.long, device=logits.device)
    everything = torch.full((1, masks.table.shape[1]), -1, dtype=torch.int32, device=logits.device)
    apply_token_bitmask(logits, everything, rows, rows)


def log_limits(
    settings: EngineSettings,
    max_model_len: int,
    num_pages: int,
    decode_graphs: bool,
    overlap: bool,
    eos_token_ids: list[int],
) -> None:
    s = settings
    log.info(
        "engine: max_model_len %d, %d KV pages x %d tokens, max_running %d, max_num_batched_tokens %d, "
        "prefix cache %s, decode CUDA graphs %s, overlapped scheduling %s, eos %s",
        max_model_len,
        num_pages,
        s.page_size,
        s.max_running,
        s.max_num_batched_tokens,
        on_off(s.enable_prefix_cache),
        on_off(decode_graphs),
        on_off(overlap),
        eos_token_ids,
    )
    if num_pages * s.page_size < max_model_len:
        log.warning(
            "the KV pool holds %d tokens, fewer than max_model_len %d: a request that outgrows the "
            "pool fails with kv_capacity_exceeded",
            num_pages * s.page_size,
            max_model_len,
        )


def on_off(flag: bool) -> str:
    return "on" if flag else "off"
