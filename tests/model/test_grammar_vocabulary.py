"""The vocabulary the grammar library masks with: text a grammar forces is tokenized as the
tokenizer tokenizes it, except that an added token's spelling stays ordinary text, its bytes as
they are, in the tokens the model can draw."""

import unicodedata

import pytest
import tokenizers

from tests.model.test_tokenizer import CORPUS
from worker.model.qwen_tokenizer import QWEN3_ADDED_TOKENS, QWEN3_FIRST_ADDED_ID
from worker.model.tokenizer import Tokenizer, TokenizerError

EOS = [151645, 151643]
MASK_VOCAB = 151936  # Qwen3's embedding rows: more than the tokenizer's 151,669 ids


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(qwen_tokenizer_dir)


@pytest.fixture(scope="module")
def tables(tokenizer):
    return tokenizer.grammar_tables(MASK_VOCAB, MASK_VOCAB, EOS)


def spells_a_marker(text: str) -> bool:
    return any(content in text for content, _ in QWEN3_ADDED_TOKENS)


def test_forced_text_gets_the_tokenizers_own_ids(tokenizer, tables):
    texts = [t for t in CORPUS if unicodedata.is_normalized("NFC", t) and not spells_a_marker(t)]
    assert len(texts) >= 150
    assert [t for t in texts if tables.tokenize_str(t) != tokenizer.encode(t, add_special_tokens=False)] == []


@pytest.mark.parametrize("marker", [content for content, _ in QWEN3_ADDED_TOKENS])
def test_a_markers_spelling_is_forced_as_ordinary_tokens(tokenizer, tables, marker):
    text = f'{{"a": "x{marker}"}}{marker}'
    ids = tables.tokenize_str(text)
    assert max(ids) < QWEN3_FIRST_ADDED_ID
    assert tokenizer.decode(ids) == text
    assert tokenizer.token_to_id(marker) in tables.tokenize_str(marker, parse_special=True)  # grammars name it


def test_forced_text_keeps_its_bytes_where_nfc_would_change_them(tokenizer, tables):
    text = "cafe\u0301 \u212b"  # NFC: "café Å"
    assert tokenizer.decode(tables.tokenize_str(text)) == text


def test_a_cut_vocabulary_spells_forced_text_with_its_own_tokens(tokenizer):
    # The suite's 2,048-token checkpoints: llguidance forced `{"` as token 4913, which they cannot draw.
    cut = tokenizer.grammar_tables(MASK_VOCAB, 2048, [])  # nor an end token: the engine keeps those it can
    for text in ['{"name": "Ada", "tags": ["x"]}', "<think>yes</think>", "naïve 日本"]:
        ids = cut.tokenize_str(text)
        assert max(ids) < 2048 and tokenizer.decode(ids) == text
    assert (cut.vocab_size, cut.eos_tokens) == (MASK_VOCAB, sorted(tokenizer.eos_token_ids))


def test_a_vocabulary_that_is_not_byte_level_bpe_is_refused(tmp_path):
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    backend.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TokenizerError, match="byte-level BPE"):
        Tokenizer.from_dir(tmp_path).grammar_tables(2, 2, [1])
