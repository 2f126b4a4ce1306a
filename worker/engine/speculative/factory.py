"""The speculator a worker's settings ask for, and the model it drafts with: a draft Qwen3
(speculative_method draft) or an EAGLE-3 head (eagle3), loaded before the KV pool is sized
because each page of the pool holds their KV too."""

from __future__ import annotations

import torch

from producer_client.errors import InvalidArgument
from worker.engine.grammar.draft_masks import DraftMasks
from worker.engine.kv_pool import KVCacheShape, pages_for
from worker.engine.scheduler import Scheduler
from worker.engine.settings import EngineSettings
from worker.engine.speculative.draft_model import DraftModelProposer, draft_kv_shape
from worker.engine.speculative.eagle3 import Eagle3Proposer
from worker.engine.speculative.ngram import NgramProposer
from worker.engine.speculative.speculator import Speculator
from worker.model.eagle3 import Eagle3Head
from worker.model.eagle3_checkpoint import load_eagle3_head
from worker.model.loader import load_model
from worker.model.presets import resolve_model_path
from worker.model.qwen3 import Qwen3ForCausalLM

SpeculativeModel = Qwen3ForCausalLM | Eagle3Head


def load_speculative_model(
    settings: EngineSettings, target: Qwen3ForCausalLM, device: torch.device
) -> SpeculativeModel | None:
    """The draft model or EAGLE-3 head, in the target's dtype on its device; None for ngram or off."""
    method = settings.speculative_method
    if method not in ("draft", "eagle3"):
        return None
    path = resolve_model_path(settings.speculative_model)
    dtype = target.model.norm.weight.dtype
    if method == "draft":
        draft = load_model(path, dtype, device).model
        check_same_vocabulary(draft.config.vocab_size, target.config.vocab_size)
        return draft
    whole_embedding = target.model.embed_tokens.weight if target.tp.size == 1 else None
    head = load_eagle3_head(path, dtype, device, whole_embedding)
    check_same_vocabulary(head.config.vocab_size, target.config.vocab_size)
    if head.config.target_hidden_size != target.config.hidden_size:
        raise InvalidArgument(
            "speculative_model",
            f"the EAGLE-3 head reads hidden states of size {head.config.target_hidden_size}, "
            f"the model's are {target.config.hidden_size}",
        )
    target.model.capture_inputs = head.config.aux_layer_inputs(target.config.num_hidden_layers)
    return head


def check_same_vocabulary(draft: int, target: int) -> None:
    # Drafted ids are the target's ids: a draft of another vocabulary would draft other tokens.
    if draft != target:
        raise InvalidArgument(
            "speculative_model",
            f"the draft's vocabulary has {draft} tokens, the model's {target}: "
            "a draft model or head must share the model's tokenizer",
        )


def speculative_kv_shape(model: SpeculativeModel, settings: EngineSettings, device: torch.device) -> KVCacheShape:
    if isinstance(model, Qwen3ForCausalLM):
        return draft_kv_shape(model, settings.page_size, settings.kv_cache_dtype, device)
    # The head's KV stays in its dtype: its keys are not normalized, so no scale bounds them for float8.
    config = model.config
    return KVCacheShape(1, config.num_key_value_heads, config.head_dim, settings.page_size, model.fc.weight.dtype)


def speculative_bytes_per_page(model: SpeculativeModel | None, settings: EngineSettings, device: torch.device) -> int:
    return 0 if model is None else speculative_kv_shape(model, settings, device).bytes_per_page


def build_speculator(
    settings: EngineSettings,
    max_model_len: int,
    model: SpeculativeModel | None,
    target: Qwen3ForCausalLM,
    scheduler: Scheduler,
    draft_masks: DraftMasks,
) -> Speculator | None:
    """The speculator over the target's pool (the scheduler's pages and page table), on its device."""
    if settings.speculative_method is None:
        return None
    device, num_pages = target.model.norm.weight.device, scheduler.allocator.num_pages
    if model is None:
        proposer = NgramProposer()
    else:
        shape = speculative_kv_shape(model, settings, device)
        if isinstance(model, Qwen3ForCausalLM):
            graphs = None
            if settings.cuda_graphs and device.type == "cuda":
                graphs = (settings.max_running, min(pages_for(max_model_len, settings.page_size), num_pages))
            proposer = DraftModelProposer(model, shape, num_pages, scheduler.page_table, device, graphs)
        else:
            proposer = Eagle3Proposer(model, target, shape, num_pages, scheduler.page_table, device)
    return Speculator(proposer, settings.num_speculative_tokens, max_model_len, draft_masks)
