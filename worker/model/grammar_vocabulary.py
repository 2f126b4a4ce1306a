"""llguidance's view of a byte-level BPE vocabulary (Qwen's), for structured outputs.

llguidance needs each token's bytes, which tokens are special (never text: a grammar names them,
as `<tool_call>`), and a tokenizer for the text a grammar forces (a JSON key, the rest of a
choice), which it forces as that text's tokens. Built from tokenizer.json it tokenizes with
`tokenizers`, which cuts an added token's spelling out of any text: forced text holding `<think>`
became token 151667, the mask allowed that token alone, and the grammar refused it as text, since
a special token is no text (issue 40: a 500 for a choice, regex or JSON string that spells one).

So forced text is tokenized by llguidance's own BPE (tiktoken's) over the ordinary tokens' ranks,
split by the pre-tokenizer's regex: Qwen's vocabulary is tiktoken ranks, of which tokenizer.json's
merges are derived (worker/model/qwen_tokenizer.py), so text gets the ids `tokenizers` gives it,
except that a marker's spelling is ordinary tokens, and its bytes are kept as they are (no NFC
normalization: they are the grammar's). The added tokens stay specials, which grammars name.

Only the tokens the model can draw get ranks: a test checkpoint whose vocabulary is cut to its
first ids has forced text spelled with those, and llguidance takes the others for placeholders
that no text matches.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import llguidance
import tokenizers


def grammar_vocabulary(
    backend: tokenizers.Tokenizer,
    token_bytes: Sequence[bytes],
    pattern: str,
    n_vocab: int,
    drawable: int,
    eos_token_ids: Sequence[int],
) -> llguidance.LLTokenizer:
    """The vocabulary over `n_vocab` ids, of which the model draws the first `drawable`: each id's
    bytes, and the regex text is split by (`split_pattern`)."""
    added = {token_id: token.content for token_id, token in backend.get_added_tokens_decoder().items()}
    ranks = {token_bytes[i]: i for i in range(min(drawable, len(token_bytes))) if i not in added}
    return llguidance.LLTokenizer.from_tiktoken(
        encoder=ranks,
        special_tokens={content: token_id for token_id, content in added.items()},
        pattern=pattern,
        eos_token=list(eos_token_ids),
        n_vocab=n_vocab,
    )


def split_pattern(backend: tokenizers.Tokenizer) -> str | None:
    """The regex a byte-level BPE tokenizer splits text by before its merges; None for another kind
    of tokenizer."""
    if not isinstance(backend.model, tokenizers.models.BPE) or not isinstance(
        backend.decoder, tokenizers.decoders.ByteLevel
    ):
        return None
    steps = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else {}
    match [steps] if steps.get("type") != "Sequence" else steps["pretokenizers"]:
        case [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "use_regex": False},
        ]:
            return pattern
    return None
