"""xgrammar against llguidance on this machine, with the real Qwen3 vocabulary: what chose
MILI's grammar library (bench/RESULTS.md, "Structured outputs").

For each library and schema: the time to build the tokenizer info once, to compile the schema
(and build its first matcher: llguidance builds its lexer then), and, over a random walk through
the grammar (each step every matcher's mask is filled, then a token the mask allows is consumed:
what decoding with random weights does), the median host time per step of filling the masks of a
batch of 16 and 64 constrained requests: llguidance one matcher after another, as MILI's mask
thread does, xgrammar through its BatchGrammarMatcher. Both emit compact JSON (`, ` and `: `, no
other whitespace), as MILI asks. CPU time is printed beside wall time: the machine is shared.

xgrammar is not a MILI dependency (it imports torch and transformers, which the client must not
need): install it apart to run this, e.g. `pip install --target /tmp/xg --no-deps xgrammar
apache-tvm-ffi` and `PYTHONPATH=/tmp/xg:.`.

    python -m bench.grammar_libraries [--steps 50] [--batches 16,64]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time

import torch

from producer_client.structured import JSON_OPTIONS
from worker.model.presets import resolve_model_path
from worker.model.tokenizer import Tokenizer

SCHEMAS = {
    "two fields": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "order (nested, enums, bounds, pattern)": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
            "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
            "customer": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 40}, "vip": {"type": "boolean"}},
                "required": ["name"],
                "additionalProperties": False,
            },
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 5,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 100},
                        "price": {"type": "number", "minimum": 0},
                    },
                    "required": ["sku", "qty", "price"],
                    "additionalProperties": False,
                },
            },
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        },
        "required": ["id", "status", "customer", "items"],
        "additionalProperties": False,
    },
    "30 fields": {
        "type": "object",
        "properties": {
            f"field_{i}": [{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}][i % 4]
            for i in range(30)
        },
        "required": [f"field_{i}" for i in range(0, 30, 2)],
        "additionalProperties": False,
    },
    "any JSON object": {"type": "object"},
}


def cpu_and_wall(fn):
    cpu, wall = time.process_time(), time.perf_counter()
    result = fn()
    return result, time.process_time() - cpu, time.perf_counter() - wall


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab: int, eos: list[int]):
        import llguidance
        import llguidance.torch

        self.llg, self.llg_torch = llguidance, llguidance.torch
        self.info = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=eos)

    def compile(self, schema: dict):
        # llguidance builds its lexer when a matcher is made: the first matcher is the compile.
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        self.matcher(grammar)
        return grammar

    def matcher(self, compiled):
        m = self.llg.LLMatcher(self.info, compiled, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def fill(self, matchers, bitmask):
        for i, m in enumerate(matchers):
            self.llg_torch.fill_next_token_bitmask(m, bitmask, i)

    def consume(self, m, token):
        assert m.consume_token(token), m.get_error()

    def restart_if_done(self, m) -> None:
        if m.is_stopped():
            m.reset()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab: int, eos: list[int]):
        import transformers
        import xgrammar

        self.xgr = xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        self.matcher(compiled)
        return compiled

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume(self, m, token):
        assert m.accept_token(token)

    def restart_if_done(self, m) -> None:
        if m.is_terminated():
            m.reset()


def allowed_tokens(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (bitmask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten()


def walk(lib, compiled, batch: int, steps: int, vocab: int, rng: random.Random) -> tuple[float, float]:
    """(CPU ms, wall ms) per step of filling the batch's masks, the median over a random walk."""
    matchers = [lib.matcher(compiled) for _ in range(batch)]
    bitmask = torch.zeros(batch, (vocab + 31) // 32, dtype=torch.int32)
    cpus, walls = [], []
    for _ in range(steps):
        _, c, w = cpu_and_wall(lambda: lib.fill(matchers, bitmask))
        cpus.append(c)
        walls.append(w)
        for i, m in enumerate(matchers):
            ids = allowed_tokens(bitmask[i], vocab)
            token = int(ids[rng.randrange(len(ids))])
            lib.consume(m, token)
            lib.restart_if_done(m)
    return 1000 * statistics.median(cpus), 1000 * statistics.median(walls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batches", default="16,64")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    path = resolve_model_path("tiny")
    tokenizer = Tokenizer.from_dir(path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    eos = sorted(tokenizer.eos_token_ids)
    for cls in (LLGuidance, XGrammar):
        lib, cpu, wall = cpu_and_wall(functools.partial(cls, tokenizer, vocab, eos))
        print(f"{cls.name}: tokenizer info {wall * 1000:.0f} ms wall, {cpu * 1000:.0f} ms CPU")
        for name, schema in SCHEMAS.items():
            compiled, cpu, wall = cpu_and_wall(functools.partial(lib.compile, schema))
            line = f"  {name:40s} compile {wall * 1000:8.1f} ms wall {cpu * 1000:8.1f} ms CPU"
            for b in batches:
                c, w = walk(lib, compiled, b, args.steps, vocab, random.Random(0))
                line += f" | batch {b}: {w:6.2f} ms wall {c:6.2f} ms CPU per step"
            print(line, flush=True)


if __name__ == "__main__":
    main()
