"""No request shape that reaches a grammar ends in a 500 (issue 40): drawn requests with formats
that spell Qwen3's markers, regexes, JSON schemas with `$ref`s, tools, thinking on and off, and
malformed formats are either refused with a 400 whose `param` is a field the request has, or
accepted; and what is accepted compiles in the worker and holds, token after token, whatever the
model draws, to an output whose answer is in the format.

Unit-level: the gateway's validation and the client's check (what the gateway runs before it
enqueues), the worker's reading of the job (its prompt, its constraint), and the engine's grammar
and masks, walked with random draws from each mask instead of a model."""

import json
import random
import re
from functools import partial
from types import SimpleNamespace

import jsonschema
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from gateway.errors import api_error_of
from openai_format.errors import APIError
from openai_format.job_specs import chat_jobs, completion_jobs, parse_body
from openai_format.requests import ChatCompletionRequest, CompletionRequest
from producer_client.chat_output import OutputFormat, parse_output
from producer_client.errors import InvalidArgument
from producer_client.new_job import build_job
from producer_client.schema import JobRequest
from producer_client.structured import ChoiceFormat, RegexFormat
from tests.structured_schemas import LEAVES, closed
from worker.engine.grammar.compiler import GrammarCompiler
from worker.engine.grammar.constraint import Phase
from worker.engine.grammar.masks import GrammarMasks
from worker.engine.grammar.request_grammar import RequestGrammar, replayed
from worker.loop.intake import constraint_of, render_prompt
from worker.model.presets import resolve_model_path
from worker.model.tokenizer import Tokenizer

VOCAB = 151936  # the tiny model's, every id of which it may draw
EOS = [151645, 151643]
STEPS = 48  # tokens drawn at most per walk
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>", "<|endoftext|>", "<|im_start|>"]
PIECES = [*MARKERS, "a", "Zq", "7", " ", "\n", "\t", "-", "é", "e\u0301", "日", '"', "\\", "{", "<", ">", "/"]
TEXTS = st.lists(st.sampled_from(PIECES), min_size=1, max_size=4).map("".join)
REGEX_PIECES = [
    *(re.sub(r"([|\\.+*?()\[\]{}^$])", r"\\\1", m) for m in MARKERS),
    "[a-z]{1,3}",
    "\\s*",
    "(ab|cd)",
    "[<>/|]",
    "x?",
    ".{0,2}",
    "[0-9]",
]
REGEXES = st.one_of(
    st.lists(st.sampled_from(REGEX_PIECES), min_size=1, max_size=4).map("".join),
    st.sampled_from(["[a-", "(?=a)b", "a{3,1}"]),  # what the grammar library cannot take
)
STRINGS = st.one_of(
    st.lists(TEXTS, min_size=1, max_size=3, unique=True).map(lambda values: {"enum": values}),
    TEXTS.map(lambda value: {"const": value}),
    REGEXES.map(lambda pattern: {"type": "string", "pattern": f"^{pattern}$"}),
    st.just({"type": "string", "maxLength": 6}),
    st.just({"type": "array", "uniqueItems": True}),  # a keyword it does not implement
)
PROPERTIES = st.dictionaries(st.sampled_from(["a", "b", "<think>"]), st.one_of(STRINGS, LEAVES), min_size=1, max_size=3)
SCHEMAS = st.one_of(
    PROPERTIES.map(lambda props: closed(props, sorted(props))),
    # A model nested under $defs, as openai.pydantic_function_tool and response_format=Model send it.
    PROPERTIES.map(
        lambda props: {
            "$defs": {"Inner": closed(props, sorted(props))},
            **closed(
                {"inner": {"$ref": "#/$defs/Inner"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}, ["inner"]
            ),
        }
    ),
)
FORMAT_FIELDS = st.one_of(
    SCHEMAS.map(lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}),
    st.sampled_from(
        [
            {"response_format": {"type": "json_object"}},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!"}}},
            {"response_format": {"type": "regex", "pattern": "a"}},  # OpenAI's field has no regex
            {"response_format": {}},
            {"response_format": {"type": "json_object", "extra": 1}},
            {"guided_choice": ["a", ""]},
            {"guided_regex": "a", "guided_choice": ["a"]},
        ]
    ),
    SCHEMAS.flatmap(lambda s: st.sampled_from([{"guided_json": s}, {"guided_json": json.dumps(s)}])),
    REGEXES.map(lambda pattern: {"guided_regex": pattern}),
    st.lists(TEXTS, min_size=1, max_size=4).map(lambda choices: {"guided_choice": choices}),
)
TOOLS = st.lists(
    st.tuples(st.sampled_from(["f", "g"]), SCHEMAS), min_size=1, max_size=2, unique_by=lambda tool: tool[0]
).map(lambda tools: [{"type": "function", "function": {"name": name, "parameters": p}} for name, p in tools])
CHAT_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "chat_template_kwargs": st.sampled_from([{"enable_thinking": True}, {"enable_thinking": False}]),
        "tools": TOOLS,
        "tool_choice": st.sampled_from(["auto", "required", "none", {"type": "function", "function": {"name": "f"}}]),
    },
)
BODIES = st.one_of(
    st.builds(
        lambda fmt, chat: {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fmt, **chat},
        st.one_of(FORMAT_FIELDS, st.just({})),
        CHAT_FIELDS,
    ),
    FORMAT_FIELDS.map(lambda fmt: {"model": "tiny", "prompt": "Answer:", **fmt}),
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model_path("tiny"))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, VOCAB, EOS, cache_size=64)
    yield compiler, GrammarMasks(VOCAB, EOS, rows=2)
    compiler.shutdown()


def gateway_jobs(body: dict) -> list[str]:
    """What the gateway does before it enqueues: the jobs' bodies, or the APIError it answers."""
    chat = "messages" in body
    req = parse_body(ChatCompletionRequest if chat else CompletionRequest, json.dumps(body))
    specs = chat_jobs(req) if chat else completion_jobs(req)
    try:
        return [build_job(s.prompt, s.messages, s.input_ids, None, None, s.priority, s.sampling).body for s in specs]
    except InvalidArgument as e:
        raise api_error_of(e, 1) from None


def names_a_field(body: dict, param: str | None, model: type) -> bool:
    """Whether the request has the field `param` (one it should not have, say), or the request's
    schema declares it and the request has every part of it but the last (a field it left out)."""
    if param is None:
        return False
    parts = param.split(".")
    node = body
    for i, part in enumerate(parts):
        node = json.loads(node) if isinstance(node, str) and i > 0 else node  # guided_json as JSON text
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            schema = model.model_json_schema()
            return i == len(parts) - 1 and declares(schema, schema["$defs"], parts)
    return True


def declares(schema: dict, defs: dict, parts: list[str]) -> bool:
    """Whether the path leads through pydantic's JSON schema; a free-form object takes any path."""
    if not parts:
        return True
    if "$ref" in schema:
        return declares(defs[schema["$ref"].rsplit("/", 1)[-1]], defs, parts)
    if "anyOf" in schema or "oneOf" in schema:
        return any(declares(s, defs, parts) for s in schema.get("anyOf", schema.get("oneOf")))
    head, rest = parts[0], parts[1:]
    if schema.get("type") == "object":
        if head in schema.get("properties", {}):
            return declares(schema["properties"][head], defs, rest)
        return schema.get("additionalProperties", False) is not False
    if schema.get("type") == "array":
        return head.isdigit() and declares(schema.get("items", {}), defs, rest)
    return not schema  # Any


def walk(grammars, tokenizer, constraint, rng: random.Random) -> list[int] | None:
    """Draws tokens at random from the request's masks, as a model would (the thinking, when the
    first token opens it, a few tokens long); the output's tokens once its grammar ended or it
    chose to end where the grammar accepts, None if it ran out of steps first."""
    compiler, masks = grammars
    grammar = RequestGrammar(constraint, compiler.submit(constraint, partial(replayed, constraint, [])), EOS)
    grammar.wait_compiled(60)
    assert grammar.start() is None  # the client's check refuses whatever the worker cannot compile
    request, tokens = SimpleNamespace(grammar=grammar, is_finished=False), []
    try:
        for _ in range(STEPS):
            masks.batch_mask([request])
            assert grammar.error is None, (tokenizer.decode(tokens), grammar.error)
            if grammar.ended or (grammar.accepts_end and rng.random() < 0.3):
                return tokens
            tokens.append(draw(grammar, masks, rng, len(tokens)))
            grammar.take(tokens[-1])
        return None
    finally:
        grammar.close()


def draw(grammar: RequestGrammar, masks: GrammarMasks, rng: random.Random, drawn: int) -> int:
    thinking = grammar.constraint.thinking
    if grammar.phase is Phase.THINKING:
        return thinking.closes if drawn >= 3 else rng.randrange(1000)
    if grammar.phase is Phase.DECIDING and rng.random() < 0.5:
        return thinking.opens
    row = masks.table[grammar.slot].numpy().view("uint32")
    allowed = [t for t in ((row[:, None] >> range(32)) & 1).flatten().nonzero()[0] if t < VOCAB and t not in EOS]
    assert allowed, "a mask that allows no token"
    return int(rng.choice(allowed))


def assert_in_format(request: JobRequest, output: OutputFormat | None, text: str) -> None:
    """The answer, once a chat's reader split it, is in the format, or the calls are the tools'."""
    chat = parse_output(text, output) if output is not None else None
    answer = text if chat is None else chat.content
    if chat is not None and chat.tool_calls:
        assert answer == ""
        schemas = {t.function.name: t.function.parameters or {} for t in request.tools}
        for call in chat.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        return
    fmt = request.params.response_format
    assert fmt is not None, text  # a forced call the reader did not find
    if isinstance(fmt, ChoiceFormat):
        assert answer in fmt.choices
    elif isinstance(fmt, RegexFormat):
        assert re.fullmatch(fmt.pattern, answer), answer  # the drawn patterns mean the same to Python
    elif fmt.type == "json_object":
        assert isinstance(json.loads(answer), dict)
    else:
        jsonschema.validate(json.loads(answer), fmt.json_schema.schema_)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODIES, seed=st.integers(0, 2**32))
# Found in CI: a choice that opens with a newline, after a think block whose reader drops it.
@example(body={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "guided_choice": ["\n"]}, seed=0)
# Found in CI: a tool's parameter whose const spells `</tool_call>`, which the reader took for the
# call's end inside the argument's string (the answer came out raw, not the calls).
@example(
    body={
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_object"},
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {
                        "type": "object",
                        "properties": {"a": {"const": "<think></tool_call>"}},
                        "required": ["a"],
                        "additionalProperties": False,
                    },
                },
            }
        ],
    },
    seed=0,
)
def test_a_request_that_reaches_a_grammar_is_refused_naming_its_field_or_holds_to_it(tokenizer, grammars, body, seed):
    try:
        jobs = gateway_jobs(body)
    except APIError as refused:
        error = refused.body.error
        model = ChatCompletionRequest if "messages" in body else CompletionRequest
        assert refused.status == 400 and names_a_field(body, error.param, model), (refused.status, error)
        event("refused")
        return
    request = JobRequest.from_json(jobs[0], 1 << 20, 32768)
    _, output = render_prompt(request, tokenizer)
    constraint = constraint_of(request, output, tokenizer)
    if constraint is None:
        event("accepted, free")
        return
    tokens = walk(grammars, tokenizer, constraint, random.Random(seed))
    event(f"accepted, {'ended' if tokens is not None else 'cut'}{', thinking' if constraint.thinking else ''}")
    if tokens is not None:
        assert_in_format(request, output, tokenizer.decode(tokens, skip_special_tokens=True))
