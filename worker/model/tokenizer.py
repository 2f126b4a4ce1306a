"""The tokenizer of a Hugging Face checkpoint directory.

tokenizer.json runs in `tokenizers`; the chat template comes from chat_template.jinja or
tokenizer_config.json and renders the way `transformers` renders it; stop ids are the union of
what tokenizer_config.json, generation_config.json and config.json name; IncrementalDetokenizer
turns generated ids into text deltas for streaming.
"""

import codecs
import functools
import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
import tokenizers.decoders
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers.decoders import DecodeStream

from producer_client.errors import MiliError
from worker.model.grammar_vocabulary import grammar_vocabulary, split_pattern

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
# The named special tokens transformers hands to every chat template (as strings, when set).
TEMPLATE_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(MiliError):
    """A tokenizer file of a checkpoint is missing or malformed; the message names the file."""

    code = "tokenizer_error"


class ChatTemplateError(MiliError):
    """The chat template is absent or cannot render these messages."""

    code = "chat_template_error"


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: jinja2.Template | None,
        template_tokens: Mapping[str, str],
        eos_token_ids: frozenset[int],
        source: Path,
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.template_tokens = dict(template_tokens)
        self.eos_token_ids = eos_token_ids
        self.source = source
        self._token_bytes: dict[bool, TokenBytes] = {}  # by skip_special_tokens, built on first use
        self._token_bytes_lock = threading.Lock()
        self._grammar_tables: dict[tuple, Any] = {}  # llguidance.LLTokenizer by grammar_tables' arguments
        self._grammar_tables_lock = threading.Lock()

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        backend = load_backend(path / TOKENIZER_FILE)
        config_path = path / TOKENIZER_CONFIG_FILE
        config = read_json_object(config_path) if config_path.exists() else {}
        template_tokens = read_template_tokens(config, config_path)
        return cls(
            backend=backend,
            chat_template=load_chat_template(path, config),
            template_tokens=template_tokens,
            eos_token_ids=collect_eos_token_ids(path, backend, template_tokens.get("eos_token")),
            source=path,
        )

    @property
    def vocab_size(self) -> int:
        """Token ids this tokenizer knows, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def grammar_tables(self, vocab_size: int, drawable: int, eos_token_ids: Sequence[int]) -> Any:
        """llguidance's view of this vocabulary over `vocab_size` ids (at least the tokenizer's
        own: a model may have more rows), of which the model draws the first `drawable`, for
        structured outputs (worker.model.grammar_vocabulary). Its end tokens: `eos_token_ids`, else
        the tokenizer's own (a model cut short of them cannot draw them). Built once per tokenizer
        and arguments, from any thread: about a second of CPU for Qwen3's vocabulary."""
        key = (vocab_size, drawable, tuple(eos_token_ids))
        with self._grammar_tables_lock:
            if key not in self._grammar_tables:
                pattern = split_pattern(self.backend)
                if pattern is None:
                    raise TokenizerError(
                        f"{self.source}: structured outputs need a byte-level BPE tokenizer that splits text by one "
                        "regex (as Qwen's does)"
                    )
                ends = list(eos_token_ids) or sorted(self.eos_token_ids)
                if not ends:
                    raise TokenizerError(f"{self.source}: structured outputs need an end-of-text token")
                token_bytes = self.token_bytes(skip_special_tokens=False).raw
                self._grammar_tables[key] = grammar_vocabulary(
                    self.backend, token_bytes, pattern, vocab_size, drawable, ends
                )
            return self._grammar_tables[key]

    def token_to_id(self, token: str) -> int | None:
        """The id of a token of the vocabulary, such as `</think>`; None if it has none."""
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def incremental_detokenizer(
        self,
        skip_special_tokens: bool = True,
    ) -> "ByteLevelDetokenizer | IncrementalDetokenizer":
        """The fastest detokenizer this vocabulary allows: the byte-level one when its decoder is ByteLevel."""
        if not isinstance(self.backend.decoder, tokenizers.decoders.ByteLevel):
            return IncrementalDetokenizer(self, skip_special_tokens)
        return ByteLevelDetokenizer(self.token_bytes(skip_special_tokens))

    def token_bytes(self, skip_special_tokens: bool) -> "TokenBytes":
        """Each id's bytes, built once per tokenizer (a pass in Python over the whole vocabulary) and
        shared by the detokenizers and the grammar tables, the one that skips special tokens derived
        from the other. From any thread: a worker's warm-up asks for it while its grammar tables are
        built on their own thread, and the second waits for the first's table."""
        with self._token_bytes_lock:
            if skip_special_tokens not in self._token_bytes:
                whole = self._token_bytes.get(False) or TokenBytes.of(self.backend)
                self._token_bytes[False] = whole
                if skip_special_tokens:
                    self._token_bytes[True] = whole.without(self.special_token_ids())
            return self._token_bytes[skip_special_tokens]

    def special_token_ids(self) -> set[int]:
        return {i for i, token in self.backend.get_added_tokens_decoder().items() if token.special}

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render like transformers' apply_chat_template; extra kwargs reach the template."""
        if self.chat_template is None:
            raise ChatTemplateError(
                f"{self.source}: no chat template ({TOKENIZER_CONFIG_FILE} has no chat_template "
                f"and there is no {CHAT_TEMPLATE_FILE})"
            )
        context = {
            **self.template_tokens,
            **kwargs,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "enable_thinking": enable_thinking,
        }
        try:
            text = self.chat_template.render(**context)
        # Templates are untrusted programs over caller data: any failure is this conversation's.
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise ChatTemplateError(f"chat template of {self.source}: {e}") from e
        # The template writes the special tokens itself, so encoding must not add more.
        return self.encode(text, add_special_tokens=False) if tokenize else text


class IncrementalDetokenizer:
    """Text deltas for streaming that concatenate to decode(all ids), for any vocabulary.

    Decoding tokens one at a time splits multi-byte characters across tokens and, in
    SentencePiece-style vocabularies, drops a word's leading space. `tokenizers`' own
    DecodeStream (Rust) handles both as vLLM's detokenize_incrementally does: it decodes a
    window of the last ids with the new one and emits what the window's text gained, holding
    it back while it ends in U+FFFD (an unfinished character). Byte-level vocabularies have a
    faster way (ByteLevelDetokenizer).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # ids[_context:_emitted] produced the last emitted text; ids[_emitted:] produced none yet.
        self._context = self._emitted = 0

    def push(self, new_ids: Iterable[int]) -> str:
        backend, ids = self.tokenizer.backend, self.ids
        delta = ""
        for token_id in new_ids:
            ids.append(token_id)
            text = self._stream.step(backend, token_id)
            if text is not None:
                delta += text
                self._context, self._emitted = self._emitted, len(ids)
        return delta

    def flush(self) -> str:
        """At the end of a stream: the text push held back, an unfinished character as U+FFFD."""
        if self._emitted == len(self.ids):
            return ""
        decode, window = self.tokenizer.decode, self.ids[self._context :]
        emitted = decode(window[: self._emitted - self._context], self.skip_special_tokens)
        delta = decode(window, self.skip_special_tokens)[len(emitted) :]
        self._context, self._emitted = self._emitted, len(self.ids)
        return delta


class TokenBytes:
    """Each token id's bytes as tokenizers' ByteLevel decoder turns it back into bytes, and its
    text where those bytes are whole UTF-8 characters (None elsewhere)."""

    def __init__(self, raw: list[bytes], texts: list[str | None]):
        self.raw = raw
        self.texts = texts

    def without(self, token_ids: set[int]) -> "TokenBytes":
        """The same table with `token_ids` spelling nothing (special tokens, when skipped)."""
        raw, texts = list(self.raw), list(self.texts)
        for token_id in token_ids:
            if token_id < len(raw):
                raw[token_id], texts[token_id] = b"", ""
        return TokenBytes(raw, texts)

    @classmethod
    def of(cls, backend: tokenizers.Tokenizer) -> "TokenBytes":
        char_to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
        to_bytes = str.maketrans(char_to_byte)  # to code points < 256, which latin-1 encodes as those bytes
        raw, texts = [], []
        for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
            token = backend.id_to_token(token_id)
            if token is None:
                token = ""
            # As the decoder does: a token with a character outside the byte alphabet is taken as its UTF-8.
            data = token.translate(to_bytes).encode("latin-1") if char_to_byte.keys() >= set(token) else token.encode()
            raw.append(data)
            texts.append(data.decode("utf-8") if is_utf8(data) else None)
        return cls(raw, texts)


class ByteLevelDetokenizer:
    """Text deltas for streaming that concatenate to decode(all ids), for a byte-level vocabulary
    (GPT-2's, Qwen's: tokenizer.json's decoder is ByteLevel).

    There decode(ids) is the UTF-8 decoding (invalid bytes as U+FFFD) of the concatenation of
    each token's bytes, whatever surrounds a token. So the text grows through one incremental
    UTF-8 decoder, which holds back an unfinished character, and a token whose bytes are whole
    characters, with nothing held back, is a table lookup: no decode call at all.
    """

    def __init__(self, tokens: TokenBytes):
        self.tokens = tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._holding = False  # the decoder holds the first bytes of a character

    def push(self, new_ids: Iterable[int]) -> str:
        raw, texts = self.tokens.raw, self.tokens.texts
        delta = ""
        for token_id in new_ids:
            if token_id >= len(raw):
                continue  # past the tokenizer's vocabulary (a model's padded rows): no text, as in decode
            text = None if self._holding else texts[token_id]
            if text is None:
                text = self._utf8.decode(raw[token_id])
                self._holding = bool(self._utf8.getstate()[0])
            delta += text
        return delta

    def flush(self) -> str:
        """At the end of a stream: an unfinished character as U+FFFD."""
        self._holding = False
        return self._utf8.decode(b"", final=True)


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by ByteLevel pre-tokenizers and decoders."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def load_backend(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise TokenizerError(f"{path}: file not found")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for every malformed file
        raise TokenizerError(f"{path}: not a valid tokenizers file ({e})") from None


def read_json_object(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return raw


def read_template_tokens(config: Mapping[str, Any], config_path: Path) -> dict[str, str]:
    """bos_token, eos_token, ...: a string, an AddedToken object ({"content": ...}) or null."""
    tokens = {}
    for name in TEMPLATE_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise TokenizerError(f"{config_path}: {name} must be a string or null, got {value!r}")
        tokens[name] = value
    return tokens


def load_chat_template(path: Path, config: Mapping[str, Any]) -> jinja2.Template | None:
    """chat_template.jinja wins over tokenizer_config.json's chat_template, as in transformers."""
    template_path = path / CHAT_TEMPLATE_FILE
    if template_path.is_file():
        return compile_chat_template(template_path.read_text(encoding="utf-8"), template_path)
    source = config.get("chat_template")
    if source is None:
        return None
    if not isinstance(source, str):
        raise TokenizerError(f"{path / TOKENIZER_CONFIG_FILE}: chat_template must be a string")
    return compile_chat_template(source, path / TOKENIZER_CONFIG_FILE)


def compile_chat_template(source: str, origin: Path) -> jinja2.Template:
    try:
        return chat_template_environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"{origin}: chat template line {e.lineno}: {e.message}") from None


def chat_template_environment() -> ImmutableSandboxedEnvironment:
    """transformers' template environment: sandboxed, trim/lstrip blocks, its tojson and helpers."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = template_tojson
    env.globals["raise_exception"] = template_raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def template_tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def template_raise_exception(message: str):
    raise jinja2.TemplateError(message)


def collect_eos_token_ids(path: Path, backend: tokenizers.Tokenizer, eos_token: str | None) -> frozenset[int]:
    """Every id any of the checkpoint's files names as end of sequence."""
    ids = set()
    if eos_token is not None:
        eos_id = backend.token_to_id(eos_token)
        if eos_id is None:
            raise TokenizerError(f"{path / TOKENIZER_CONFIG_FILE}: eos_token {eos_token!r} is not in {TOKENIZER_FILE}")
        ids.add(eos_id)
    for name in (GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE):
        if (path / name).exists():
            ids.update(read_eos_token_id(path / name))
    return frozenset(ids)


def read_eos_token_id(path: Path) -> list[int]:
    value = read_json_object(path).get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    for v in values:
        if type(v) is not int or v < 0:
            raise TokenizerError(f"{path}: eos_token_id must be a non-negative int or a list of them, got {value!r}")
    return values
