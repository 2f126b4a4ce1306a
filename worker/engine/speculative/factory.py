"""The speculator a worker's settings ask for, and the model it drafts with."""

from __future__ import annotations

import torch

from producer_client.errors import InvalidArgument
from worker.engine.page_table import PageTable
from worker.engine.settings import EngineSettings
from worker.engine.speculative.draft_model import DraftModelProposer, draft_kv_shape
from worker.engine.speculative.ngram import NgramProposer
from worker.engine.speculative.speculator import Speculator
from worker.model.config import Qwen3Config
from worker.model.loader import load_model
from worker.model.presets import resolve_model_path
from worker.model.qwen3 import Qwen3ForCausalLM


def load_draft_model(
    settings: EngineSettings, target: Qwen3ForCausalLM, device: torch.device
) -> Qwen3ForCausalLM | None:
    """The draft model of speculative_method draft, in the target's dtype on its device; None otherwise."""
    if settings.speculative_method != "draft":
        return None
    draft = load_model(resolve_model_path(settings.speculative_model), target.model.norm.weight.dtype, device)
    check_same_vocabulary(draft.config, target.config)
    return draft.model


def check_same_vocabulary(draft: Qwen3Config, target: Qwen3Config) -> None:
    # Drafted ids are the target's ids: a draft of another vocabulary would draft other tokens.
    if draft.vocab_size != target.vocab_size:
        raise InvalidArgument(
            "speculative_model",
            f"the draft's vocabulary has {draft.vocab_size} tokens, the model's {target.vocab_size}: "
            "a draft model must share the model's tokenizer",
        )


def draft_bytes_per_page(draft: Qwen3ForCausalLM | None, settings: EngineSettings, device: torch.device) -> int:
    if draft is None:
        return 0
    return draft_kv_shape(draft, settings.page_size, settings.kv_cache_dtype, device).bytes_per_page


def build_speculator(
    settings: EngineSettings,
    max_model_len: int,
    draft: Qwen3ForCausalLM | None,
    num_pages: int,
    page_table: PageTable,
    device: torch.device,
) -> Speculator | None:
    if settings.speculative_method is None:
        return None
    if draft is not None:
        shape = draft_kv_shape(draft, settings.page_size, settings.kv_cache_dtype, device)
        proposer = DraftModelProposer(draft, shape, num_pages, page_table, device)
    else:
        proposer = NgramProposer()
    return Speculator(proposer, settings.num_speculative_tokens, max_model_len)
