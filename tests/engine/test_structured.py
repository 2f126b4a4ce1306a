"""Structured outputs in the engine, on a random model: its preferences are noise, so every
output is whatever the mask let through. Each constrained output must parse and validate, end
only where the grammar accepts it, survive preemption and resumption unchanged, and leave the
requests beside it in the batch untouched."""

import itertools
import json
import re
import threading
from functools import partial
from types import SimpleNamespace
from unittest import mock

import jsonschema
import openai
import pydantic
import pytest
import tokenizers
import torch

from producer_client.chat_output import ChatOutput, OutputFormat, Reasoning, parse_output
from producer_client.schema import SamplingParams
from tests.engine.test_engine import random_prompts
from tests.engine.test_resume import run, text_of, tokens_of
from tests.structured_schemas import closed
from worker.engine import Engine, EngineSettings
from worker.engine.grammar.constraint import Constraint, Thinking, ToolFunction, tool_call_constraint
from worker.engine.grammar.masks import GrammarMasks
from worker.engine.grammar.request_grammar import RequestGrammar, replayed
from worker.model import tokenizer as tokenizer_module
from worker.model.presets import resolve_model_path
from worker.model.qwen_tokenizer import QWEN3_FIRST_ADDED_ID
from worker.model.tokenizer import Tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,3}$"}, "maxItems": 2},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
THINK_OPEN, THINK_END = 151667, 151668  # Qwen3's <think> and </think>


def constrained(**params) -> SamplingParams:
    return SamplingParams(max_tokens=80, response_format=FORMAT, **params)


def assert_valid(output, schema=PERSON) -> None:
    assert output.finish_reason == "stop", (output.finish_reason, output.text, output.error)
    jsonschema.validate(json.loads(output.text), schema)


SAMPLINGS = {
    "greedy": dict(temperature=0),
    "sampled": dict(temperature=1.0, seed=5),
    "top-k, top-p": dict(temperature=0.8, top_k=40, top_p=0.9, seed=6),
    "penalties": dict(temperature=0.7, seed=7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
    "greedy, penalties, min_p": dict(temperature=0, repetition_penalty=1.2, min_p=0.05),
}


def device_engine(make_tiny_engine, overlap_schedule: bool = True):
    """On CUDA the engine as it serves (decode CUDA graphs, the Triton mask kernel, mask rows copied
    to the device behind the model; overlapped unless asked not to be); on CPU the same schedule."""
    if torch.cuda.is_available():
        return Engine.from_pretrained(
            "tiny", device="cuda", num_pages=256, page_size=4, overlap_schedule=overlap_schedule
        )
    return make_tiny_engine(overlap_schedule=overlap_schedule)


@pytest.mark.slow
@pytest.mark.cuda
def test_every_output_parses_and_validates_greedy_and_sampled_and_overlapped_equals_synchronous(make_tiny_engine):
    prompts = random_prompts(len(SAMPLINGS), 2, 30, seed=40)
    params = [constrained(**p) for p in SAMPLINGS.values()]
    sync = device_engine(make_tiny_engine, overlap_schedule=False).generate(prompts, params)
    for out in sync:
        assert_valid(out)
    overlapped = device_engine(make_tiny_engine).generate(prompts, params)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in sync]


@pytest.mark.cuda
def test_free_requests_beside_constrained_ones_draw_what_they_draw_alone(make_tiny_engine):
    # Overlapped: the constrained rows read the previous step between the model and the sampler.
    prompts = random_prompts(4, 2, 30, seed=42)
    free = [SamplingParams(temperature=0, max_tokens=16), SamplingParams(temperature=1.0, seed=3, max_tokens=16)]
    alone = device_engine(make_tiny_engine).generate(prompts[:2], free)
    mixed = device_engine(make_tiny_engine).generate(prompts, free + [constrained(temperature=0), constrained(seed=2)])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    for out in mixed[2:]:
        assert_valid(out)


def test_output_cut_by_max_tokens_before_the_json_closes_ends_with_length(make_tiny_engine):
    out = make_tiny_engine().generate(
        random_prompts(1, 5, 5, seed=43),
        SamplingParams(
            temperature=0,
            max_tokens=4,
            response_format=FORMAT,
        ),
    )[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.text.startswith('{"name": "')


def test_stop_ids_end_the_output_only_where_the_grammar_accepts(make_tiny_engine):
    # Every token of a first run is a stop id of the second: a stop before the JSON closed would
    # end it invalid, so each is drawn as an ordinary token there, and the output is the same.
    engine = make_tiny_engine()
    prompts = random_prompts(2, 2, 20, seed=44)
    samplings = [dict(temperature=0), dict(temperature=1.5, seed=2)]
    free = engine.generate(prompts, [constrained(**p) for p in samplings])
    stopped = engine.generate(
        prompts, [constrained(stop_token_ids=sorted(set(out.token_ids)), **p) for out, p in zip(free, samplings)]
    )
    for before, after in zip(free, stopped):
        assert_valid(after)
        assert after.token_ids == before.token_ids


def test_a_grammar_ends_the_request_without_an_eos_even_with_ignore_eos(make_tiny_engine):
    engine = make_tiny_engine()
    for params in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        out = engine.generate(random_prompts(1, 3, 3, seed=45), constrained(ignore_eos=True, **params))[0]
        assert_valid(out)
        assert not set(out.token_ids) & set(engine.eos_token_ids)


@pytest.mark.parametrize(
    "params,cut",
    [
        (dict(temperature=0), 1),
        (dict(temperature=0), 9),
        (dict(temperature=1.0, seed=9), 6),
    ],
    ids=["greedy-1", "greedy-9", "seeded-6"],
)
def test_a_resumed_constrained_request_replays_its_tokens_into_a_fresh_matcher(make_tiny_engine, params, cut):
    engine = make_tiny_engine()
    prompt = random_prompts(1, 4, 20, seed=46)[0]
    whole, whole_final = run(engine, "whole", prompt, constrained(**params))
    resumed, final = run(engine, "resumed", prompt, constrained(**params), resume=tokens_of(whole[:cut]))
    assert tokens_of(whole[:cut]) + tokens_of(resumed) == tokens_of(whole)
    assert text_of(whole[:cut]) + text_of(resumed) == text_of(whole)
    assert final.finish_reason == whole_final.finish_reason == "stop"
    jsonschema.validate(json.loads(text_of(whole)), PERSON)


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0, seed=9)], ids=["greedy", "seeded"])
def test_a_request_resumed_with_tokens_that_complete_its_grammar_ends_at_once_as_stop(make_tiny_engine, params):
    # The run died after reading the token that completed the grammar, before the step that ends it.
    engine = make_tiny_engine()
    prompt = random_prompts(1, 4, 20, seed=46)[0]
    whole, whole_final = run(engine, "whole", prompt, constrained(**params))
    assert whole_final.new_token_ids == [] and whole_final.finish_reason == "stop"
    before = engine.stats()
    resumed, final = run(engine, "resumed", prompt, constrained(**params), resume=tokens_of(whole))
    assert resumed == [([], final.text_delta)]  # its one output is the end: no token drawn again
    assert text_of(whole[:-1]) + text_of(resumed) == text_of(whole)
    assert (final.finish_reason, final.error) == ("stop", None)
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(prompt), len(tokens_of(whole)))
    assert engine.stats().computed_tokens == before.computed_tokens  # nothing ran: not even its prefill
    jsonschema.validate(json.loads(text_of(whole)), PERSON)


def test_resume_tokens_the_grammar_refuses_fail_the_request(make_tiny_engine):
    engine = make_tiny_engine()
    bad = engine.tokenizer.encode('["not an object"]', add_special_tokens=False)
    _, final = run(engine, "bad", random_prompts(1, 4, 4, seed=47)[0], constrained(temperature=0), resume=bad)
    assert final.finish_reason == "error" and final.error.code == "invalid_argument"
    assert "resume_token_ids" in final.error.message


@pytest.mark.slow
def test_preempted_constrained_requests_recompute_and_stay_valid(make_tiny_engine):
    prompts = random_prompts(3, 20, 40, seed=48)
    params = [constrained(**p) for p in list(SAMPLINGS.values())[:3]]
    roomy = make_tiny_engine().generate(prompts, params)
    cramped = make_tiny_engine(num_pages=24)
    outputs = cramped.generate(prompts, params)
    assert cramped.stats().preemptions > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in roomy]
    for out in outputs:
        assert_valid(out)


def test_a_schema_that_does_not_compile_fails_its_request_alone(make_tiny_engine):
    engine = make_tiny_engine()
    unsatisfiable = {
        "type": "json_schema",
        "json_schema": {
            "name": "x",
            "schema": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
                "required": ["a"],
            },
        },
    }
    bad, good = engine.generate(
        random_prompts(2, 3, 3, seed=49),
        [
            SamplingParams(temperature=0, response_format=unsatisfiable),
            constrained(temperature=0),
        ],
    )
    assert bad.finish_reason == "error" and bad.error.code == "invalid_argument" and bad.token_ids == []
    assert "unsatisfiable" in bad.error.message.lower() and bad.error.message.startswith("response_format")
    assert_valid(good)


def test_a_grammar_still_compiling_holds_no_one_back(make_tiny_engine):
    engine = make_tiny_engine()
    release = threading.Event()
    engine.grammars.submit(Constraint('start: "x"'), lambda m: release.wait(30))  # the compile thread is busy
    engine.add_request("slow", random_prompts(1, 3, 3, seed=50)[0], constrained(temperature=0))
    engine.add_request("free", random_prompts(1, 3, 3, seed=51)[0], SamplingParams(temperature=0, max_tokens=5))
    finished = set()
    for _ in range(6):
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"free"}  # it ran to its end while the other's grammar waited
    release.set()
    while engine.has_unfinished():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"free", "slow"}


def test_warm_up_builds_the_vocabulary_s_tables_so_that_no_step_waits_for_them(tiny_loaded):
    """Their build holds the GIL up to 0.9 s in one stretch (inside llguidance): at the first
    structured request it stopped a serving loop for that long, heartbeat included."""
    (model, config, generation), _ = tiny_loaded
    tokenizer = Tokenizer.from_dir(resolve_model_path("tiny"))  # its own: no tables built yet
    eos = list(generation.eos_token_ids) + list(tokenizer.eos_token_ids)
    engine = Engine(
        model, config, tokenizer, EngineSettings.parse(num_pages=256, page_size=4), eos, torch.device("cpu")
    )
    vocabulary = tokenizer_module.grammar_vocabulary
    with mock.patch.object(tokenizer_module, "grammar_vocabulary", wraps=vocabulary) as builds:
        engine.warm_up()
        assert builds.call_count == 1
        [output] = engine.generate(random_prompts(1, 3, 9, seed=56), constrained(temperature=0))
        assert_valid(output)
        assert builds.call_count == 1


def test_a_tokenizer_the_grammar_library_cannot_take_warms_up_and_serves_all_but_structured_outputs(
    tiny_loaded, tmp_path
):
    (model, config, generation), _ = tiny_loaded
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer.from_dir(tmp_path)  # not byte-level BPE
    engine = Engine(
        model, config, tokenizer, EngineSettings.parse(num_pages=256, page_size=4), [1], torch.device("cpu")
    )
    engine.warm_up()
    free, bound = engine.generate(
        [[0, 0, 0]] * 2, [SamplingParams(temperature=0, max_tokens=4), constrained(temperature=0)]
    )
    assert free.finish_reason == "length" and len(free.token_ids) == 4
    assert bound.finish_reason == "error" and bound.token_ids == []
    assert "byte-level BPE" in bound.error.message


def test_grammars_compile_once_and_are_reused(make_tiny_engine):
    engine = make_tiny_engine()
    params = SamplingParams(temperature=0, max_tokens=3, response_format=FORMAT)
    engine.generate(random_prompts(3, 3, 9, seed=52), params)
    engine.generate(random_prompts(1, 3, 9, seed=53), params)
    stats = engine.stats()
    assert (stats.grammar_compiles, stats.grammar_cache_hits) == (1, 3)
    assert stats.grammar_compile_seconds > 0


def test_the_cache_keeps_at_most_its_size_and_drops_the_least_recently_used(make_tiny_engine):
    engine = make_tiny_engine(grammar_cache_size=2)
    choice = [{"type": "choice", "choices": [w]} for w in ("alpha", "beta", "gamma")]
    prompt = random_prompts(1, 3, 3, seed=54)
    for i in (0, 1, 0, 2, 0, 1):  # 1 is the least recently used when 2 arrives
        engine.generate(prompt, SamplingParams(temperature=0, response_format=choice[i]))
    stats = engine.stats()
    assert (stats.grammar_compiles, stats.grammar_cache_hits) == (4, 2)


def test_regex_and_choice_formats(make_tiny_engine):
    engine = make_tiny_engine()
    regex = {"type": "regex", "pattern": "[0-9]{3}-[a-z]{2,4}"}
    choice = {"type": "choice", "choices": ["yes", "no", "maybe so"]}
    outputs = engine.generate(
        random_prompts(4, 3, 10, seed=55),
        [
            SamplingParams(temperature=0, response_format=regex),
            SamplingParams(temperature=1.0, seed=4, response_format=regex),
            SamplingParams(temperature=0, response_format=choice),
            SamplingParams(temperature=1.0, seed=4, response_format=choice),
        ],
    )
    for out in outputs[:2]:
        assert out.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", out.text), out.text
    for out in outputs[2:]:
        assert out.finish_reason == "stop" and out.text in choice["choices"]


def drive(engine, requests) -> dict:
    """Adds `requests` ({id: (prompt, params, constraint, resume)}) and steps until all end;
    {id: (output tokens, text, final output)}."""
    for request_id, (prompt, params, constraint, resume) in requests.items():
        engine.add_request(request_id, prompt, params, resume_token_ids=resume, constraint=constraint)
    tokens = {r: [] for r in requests}
    texts = {r: "" for r in requests}
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            texts[out.request_id] += out.text_delta
            if out.finished:
                finals[out.request_id] = out
    return {r: (tokens[r], texts[r], finals[r]) for r in requests}


def test_a_thinking_request_is_free_until_think_end_and_never_ends_before_it(make_tiny_engine):
    engine = make_tiny_engine()
    prompt = random_prompts(1, 5, 5, seed=56)[0]
    thinking = Constraint.of_format(constrained().response_format, Thinking(THINK_END))
    # Before </think> the draws are those of a free request that may not stop yet (min_tokens).
    ran = drive(
        engine,
        {
            "thinking": (prompt, SamplingParams(temperature=0, max_tokens=12), thinking, ()),
            "free": (prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=12), None, ()),
        },
    )
    assert ran["thinking"][2].finish_reason == "length"
    assert ran["thinking"][0] == ran["free"][0]


def test_after_think_end_the_grammar_holds_from_the_next_token(make_tiny_engine):
    engine = make_tiny_engine()
    prompt = random_prompts(1, 5, 5, seed=57)[0]
    thought = engine.tokenizer.encode("<think>\nhmm {not json\n</think>\n\n", add_special_tokens=False)
    assert thought[0] == THINK_OPEN and THINK_END in thought
    # The prompt opened the thinking (the output starts inside it), or the output may open it.
    for thinking, resume in ((Thinking(THINK_END), thought[1:]), (Thinking(THINK_END, opens=THINK_OPEN), thought)):
        constraint = Constraint.of_format(constrained().response_format, thinking)
        for params in (
            SamplingParams(temperature=0, max_tokens=200),
            SamplingParams(temperature=1.0, seed=3, max_tokens=200),
        ):
            _, answer, final = drive(engine, {"t": (prompt, params, constraint, resume)})["t"]
            assert final.finish_reason == "stop"
            jsonschema.validate(json.loads(answer), PERSON)


def test_a_request_that_may_think_answers_at_once_unless_its_first_token_opens_the_thinking(make_tiny_engine):
    engine = make_tiny_engine()
    constraint = Constraint.of_format(constrained().response_format, Thinking(THINK_END, opens=THINK_OPEN))
    for seed in range(3):
        tokens, text, final = drive(
            engine,
            {
                "t": (
                    random_prompts(1, 5, 5, seed=60 + seed)[0],
                    SamplingParams(temperature=1.0, seed=seed, max_tokens=80),
                    constraint,
                    (),
                )
            },
        )["t"]
        if tokens[0] == THINK_OPEN:
            continue  # it thinks: free until </think>, which a random model does not write in time
        assert final.finish_reason == "stop"
        jsonschema.validate(json.loads(text), PERSON)


def test_a_required_tool_call_is_one_of_the_tools_with_valid_arguments(make_tiny_engine):
    weather = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}},
        "required": ["city"],
        "additionalProperties": False,
    }
    nothing = {"type": "object", "properties": {}, "additionalProperties": False}
    tools = [ToolFunction("get_weather", weather), ToolFunction("now", nothing)]
    engine = make_tiny_engine()
    prompt = random_prompts(1, 4, 4, seed=58)[0]
    for parallel in (False, True):
        constraint = tool_call_constraint(tools, parallel)
        for params in (
            SamplingParams(temperature=0, max_tokens=120),
            SamplingParams(temperature=1.0, seed=8, max_tokens=120),
        ):
            _, text, final = drive(engine, {"t": (prompt, params, constraint, ())})["t"]
            assert final.finish_reason == "stop", text
            calls = parse_tool_calls(text)
            assert calls and (parallel or len(calls) == 1)
            for call in calls:
                jsonschema.validate(call["arguments"], {"get_weather": weather, "now": nothing}[call["name"]])


def test_a_named_function_is_the_only_one_called(make_tiny_engine):
    weather = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"]}
    constraint = tool_call_constraint([ToolFunction("get_weather", weather)], False)
    _, text, final = drive(
        make_tiny_engine(),
        {
            "t": (
                random_prompts(1, 4, 4, seed=59)[0],
                SamplingParams(temperature=1.0, seed=1, max_tokens=60),
                constraint,
                (),
            )
        },
    )["t"]
    [call] = parse_tool_calls(text)
    assert call["name"] == "get_weather" and call["arguments"]["city"] in ("Oslo", "Lima")


class Item(pydantic.BaseModel):
    sku: str = pydantic.Field(pattern="^[A-Z]{2}$")
    count: int = pydantic.Field(ge=1, le=9)


class Order(pydantic.BaseModel):
    items: list[Item] = pydantic.Field(min_length=1, max_length=2)
    note: Item | None


def test_a_forced_call_holds_to_parameters_whose_refs_point_into_their_own_defs(make_tiny_engine):
    # What openai.pydantic_function_tool sends for nested models: `$ref`s to the parameters' `$defs`.
    function = openai.pydantic_function_tool(Order)["function"]
    assert "$defs" in function["parameters"] and "$ref" in json.dumps(function["parameters"]["properties"])
    engine = make_tiny_engine()
    constraint = tool_call_constraint([ToolFunction("Order", function["parameters"])], False)
    for seed in (1, 2):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=100)
        _, text, final = drive(engine, {"t": (random_prompts(1, 4, 4, seed=61)[0], params, constraint, ())})["t"]
        assert (final.finish_reason, final.error) == ("stop", None), text
        [call] = parse_tool_calls(text)
        assert call["name"] == "Order"
        jsonschema.validate(call["arguments"], function["parameters"])


def parse_tool_calls(text: str) -> list[dict]:
    """Qwen3's tool call blocks, each `<tool_call>`, the call's JSON, `</tool_call>` on lines of their own."""
    lines = text.split("\n")
    assert len(lines) % 3 == 0, text
    calls = []
    for i in range(0, len(lines), 3):
        assert (lines[i], lines[i + 2]) == ("<tool_call>", "</tool_call>"), text
        calls.append(json.loads(lines[i + 1]))
    return calls


def test_with_auto_tool_choice_and_a_format_the_output_is_calls_or_the_answer(make_tiny_engine):
    answer = constrained().response_format
    constraint = tool_call_constraint(
        [ToolFunction("now", {"type": "object", "properties": {}, "additionalProperties": False})], True, answer
    )
    engine = make_tiny_engine()
    for seed in range(3):
        _, text, final = drive(
            engine,
            {
                "t": (
                    random_prompts(1, 4, 4, seed=70 + seed)[0],
                    SamplingParams(temperature=1.0, seed=seed, max_tokens=120),
                    constraint,
                    (),
                )
            },
        )["t"]
        assert final.finish_reason == "stop", text
        if text.startswith("<tool_call>"):
            assert all(call["name"] == "now" for call in parse_tool_calls(text))
        else:
            jsonschema.validate(json.loads(text), PERSON)


def allowed_tokens(engine, masks: GrammarMasks, constraint: Constraint, taken=()) -> set[int]:
    """The tokens a request's mask row allows, once it has taken `taken`."""
    grammar = RequestGrammar(constraint, engine.grammars.submit(constraint, partial(replayed, constraint, [])), [])
    grammar.wait_compiled(30)
    assert grammar.start() is None
    for token in taken:
        grammar.take(token)
    masks.batch_mask([SimpleNamespace(grammar=grammar, is_finished=False)])
    bits = (masks.table[grammar.slot][:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    grammar.close()
    return set(bits.flatten().nonzero().flatten().tolist())


def test_a_mask_row_allows_what_the_phase_allows(make_tiny_engine):
    engine = make_tiny_engine()
    masks = GrammarMasks(engine.masks.table.shape[1] * 32, engine.eos_token_ids, 4)
    fmt = constrained().response_format
    deciding, thinking = Thinking(THINK_END, THINK_OPEN), Thinking(THINK_END)
    allowed = {
        "answering": allowed_tokens(engine, masks, Constraint.of_format(fmt)),
        "deciding": allowed_tokens(engine, masks, Constraint.of_format(fmt, deciding)),
        "thinking": allowed_tokens(engine, masks, Constraint.of_format(fmt, thinking)),
        "after thinking": allowed_tokens(engine, masks, Constraint.of_format(fmt, thinking), [THINK_END]),
    }
    decode = engine.tokenizer.decode
    assert allowed["answering"] and all(decode([t]).startswith("{") for t in allowed["answering"])
    # Without a think block the answer is the format from its first token, which may open the block instead.
    assert THINK_OPEN in allowed["deciding"] and allowed["answering"] <= allowed["deciding"]
    assert all(decode([t]).startswith("{") for t in allowed["deciding"] - {THINK_OPEN})
    assert allowed["thinking"] == set(range(masks.table.shape[1] * 32)) - set(engine.eos_token_ids)
    # After one, up to four newlines may come first: Qwen3's blank line.
    after = {decode([t]) for t in allowed["after thinking"]}
    assert {text for text in after if not text.strip("\n")} == {"\n", "\n\n", "\n\n\n", "\n\n\n\n"}
    assert all(re.fullmatch(r"\n{0,4}(\{.*)?", text, re.DOTALL) for text in after), after


# Formats whose text spells Qwen3's markers, and their outputs' check.
MARKER_FORMATS = {
    "choice": (
        {"type": "choice", "choices": ["<think>yes</think>", "<tool_call>no</tool_call>", "<|im_end|>"]},
        lambda text: text in ("<think>yes</think>", "<tool_call>no</tool_call>", "<|im_end|>"),
    ),
    "regex": (
        {"type": "regex", "pattern": "<tool_call>[a-z]{2}</tool_call><\\|endoftext\\|>"},
        lambda text: re.fullmatch(r"<tool_call>[a-z]{2}</tool_call><\|endoftext\|>", text),
    ),
    "json string": (
        {
            "type": "json_schema",
            "json_schema": {
                "name": "m",
                "schema": closed({"m": {"enum": ["<think>", "</think>x"]}, "n": {"const": "<|im_start|>"}}, ["m", "n"]),
            },
        },
        lambda text: json.loads(text)["n"] == "<|im_start|>" and json.loads(text)["m"] in ("<think>", "</think>x"),
    ),
}


@pytest.mark.parametrize("kind", MARKER_FORMATS)
def test_text_that_spells_a_marker_is_written_in_ordinary_tokens(make_tiny_engine, kind):
    # Its spelling was forced as the marker's own token, which the grammar then refused as text.
    fmt, valid = MARKER_FORMATS[kind]
    engine = make_tiny_engine()
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40, response_format=fmt) for seed in range(3)]
    for out in engine.generate(random_prompts(3, 3, 6, seed=80), params):
        assert (out.finish_reason, out.error) == ("stop", None) and valid(out.text), (out.text, out.error)
        assert max(out.token_ids) < QWEN3_FIRST_ADDED_ID


def test_with_thinking_and_no_think_block_the_answer_is_exactly_the_format(make_tiny_engine):
    engine = make_tiny_engine()
    choice = SamplingParams(response_format={"type": "choice", "choices": ["green", "red"]}).response_format
    formats = {"json": constrained().response_format, "choice": choice}
    answered = 0
    for (kind, fmt), seed in itertools.product(formats.items(), range(4)):
        constraint = Constraint.of_format(fmt, Thinking(THINK_END, opens=THINK_OPEN))
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=80)
        tokens, text, final = drive(engine, {"t": (random_prompts(1, 5, 5, seed=90)[0], params, constraint, ())})["t"]
        if tokens[0] == THINK_OPEN:
            continue  # it thinks: free until </think>, which a random model does not write in time
        answered += 1
        assert final.finish_reason == "stop"
        assert text in ("green", "red") if kind == "choice" else text.startswith("{"), text
    assert answered >= 4


def test_with_thinking_an_answer_without_a_think_block_never_opens_with_think(make_tiny_engine):
    # The reader takes such an opening for the reasoning (producer_client.chat_output): the answer would land there.
    engine = make_tiny_engine()
    masks = GrammarMasks(engine.masks.table.shape[1] * 32, engine.eos_token_ids, 4)
    deciding = Thinking(THINK_END, THINK_OPEN)
    opening_only = SamplingParams(response_format={"type": "choice", "choices": ["<think>yes</think>", " <think>"]})
    assert allowed_tokens(engine, masks, Constraint.of_format(opening_only.response_format, deciding)) == {THINK_OPEN}
    regex = SamplingParams(response_format={"type": "regex", "pattern": "<(think|tool)>[a-z]{2}"}).response_format
    reader = OutputFormat(reasoning=Reasoning.OPTIONAL)
    outputs = {}
    for seed in range(6):
        constraint = Constraint.of_format(regex, deciding)
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=40)
        tokens, text, final = drive(engine, {"t": (random_prompts(1, 5, 5, seed=91)[0], params, constraint, ())})["t"]
        if tokens[0] != THINK_OPEN:
            assert final.finish_reason == "stop" and re.fullmatch("<tool>[a-z]{2}", text), text
            assert parse_output(text, reader) == ChatOutput(text, "", [])
            outputs[seed] = text
    assert len(outputs) >= 2


def test_with_thinking_an_answer_after_the_think_block_may_open_with_think(make_tiny_engine):
    engine = make_tiny_engine()
    thought = engine.tokenizer.encode("<think>\nhmm\n</think>\n\n", add_special_tokens=False)
    fmt = SamplingParams(response_format={"type": "choice", "choices": ["<think>yes</think>"]}).response_format
    constraint = Constraint.of_format(fmt, Thinking(THINK_END, THINK_OPEN))
    params = SamplingParams(temperature=0, max_tokens=40)
    _, text, final = drive(engine, {"t": (random_prompts(1, 5, 5, seed=92)[0], params, constraint, thought)})["t"]
    assert (final.finish_reason, text.lstrip("\n")) == ("stop", "<think>yes</think>")  # more of the blank line first
    whole = engine.tokenizer.decode(thought) + text
    assert parse_output(whole, OutputFormat(reasoning=Reasoning.OPTIONAL)) == ChatOutput(
        "<think>yes</think>", "hmm", []
    )
