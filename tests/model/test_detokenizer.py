"""Tokenizer.incremental_detokenizer: the byte-level detokenizer Qwen3's vocabulary gets, against
tokenizers' own decode, and the DecodeStream one any other vocabulary gets."""

import random

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from tests.model.test_tokenizer import STREAM_TEXTS
from worker.model.tokenizer import ByteLevelDetokenizer, IncrementalDetokenizer, Tokenizer

MODEL_VOCAB = 151_936  # Qwen3's embedding rows: ids past the tokenizer's 151,669 decode to nothing


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(qwen_tokenizer_dir)


def streamed(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool) -> tuple[list[str], str]:
    detokenizer = tokenizer.incremental_detokenizer(skip_special_tokens)
    return [detokenizer.push([i]) for i in ids], detokenizer.flush()


def test_a_byte_level_vocabulary_gets_the_byte_level_detokenizer(tokenizer):
    assert isinstance(tokenizer.incremental_detokenizer(), ByteLevelDetokenizer)


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_streamed_text_is_the_full_decode_and_never_shows_half_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    deltas, rest = streamed(tokenizer, ids, skip_special_tokens=True)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert rest == "" and not any("\ufffd" in d for d in deltas)


def test_random_ids_stream_to_exactly_what_decode_gives(tokenizer):
    """Tokens that end mid-character, invalid byte sequences, special and added tokens, and ids
    past the tokenizer's vocabulary, with and without skipping special tokens."""
    partial = [i for i in range(tokenizer.backend.get_vocab_size()) if "\ufffd" in tokenizer.decode([i])]
    added = list(tokenizer.backend.get_added_tokens_decoder())
    assert len(partial) > 1000 and len(added) == 26
    rng = random.Random(3)
    for skip_special_tokens in (True, False):
        for _ in range(2000):
            pool = [rng.choice(partial), rng.choice(added), rng.randrange(MODEL_VOCAB), rng.randrange(MODEL_VOCAB)]
            ids = [rng.choice(pool) for _ in range(rng.randint(1, 10))]
            deltas, rest = streamed(tokenizer, ids, skip_special_tokens)
            assert "".join(deltas) + rest == tokenizer.decode(ids, skip_special_tokens), ids


def test_an_unfinished_character_waits_for_its_last_bytes_or_the_flush(tokenizer):
    ids = tokenizer.encode("ok 🧑‍🔬")
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    deltas, rest = streamed(tokenizer, ids[:cut], skip_special_tokens=True)
    assert "".join(deltas) == "ok " and rest == "\ufffd"
    deltas, rest = streamed(tokenizer, ids, skip_special_tokens=True)
    assert "".join(deltas) == "ok 🧑‍🔬" and rest == ""


def test_another_vocabulary_streams_through_decode_stream(tmp_path):
    """A WordPiece vocabulary: its decoder joins '##' pieces, so tokens do not decode on their own."""
    vocab = {"[UNK]": 0, "un": 1, "##believ": 2, "##able": 3, "story": 4, "a": 5}
    backend = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer.from_dir(tmp_path)
    ids = tokenizer.encode("a unbelievable story")
    detokenizer = tokenizer.incremental_detokenizer()
    assert isinstance(detokenizer, IncrementalDetokenizer)
    assert "".join(detokenizer.push([i]) for i in ids) + detokenizer.flush() == "a unbelievable story"
