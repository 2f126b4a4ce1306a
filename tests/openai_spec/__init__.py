"""OpenAI's published OpenAPI spec as the tests' oracle: the component schemas in schemas.json
(extracted by extract.py from github.com/openai/openai-openapi at the commit it records), and
`check(name, instance)`, which fails naming every way `instance` deviates from schema `name`, and
`spec_text(pointer)`, a description of the spec that states a rule no schema can (extract.py's TEXTS)."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

from jsonschema import Draft202012Validator

SPEC = json.loads((Path(__file__).parent / "schemas.json").read_text())
COMMIT = SPEC["commit"]


def spec_text(pointer: str) -> str:
    """The description at `pointer` in the spec, whitespace made single spaces (its lines wrap)."""
    return " ".join(SPEC["texts"][pointer].split())


@functools.cache
def validator(name: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"#/$defs/{name}", "$defs": definitions()})


def definitions() -> dict:
    """The spec's definitions, and one the spec lacks: a text completion's stream chunk. The spec
    describes streamed text completions with CreateCompletionResponse, whose finish_reason is
    not nullable, while OpenAI sends null in every chunk but the last (and so does MILI)."""
    defs = dict(SPEC["$defs"])
    chunk = copy.deepcopy(defs["CreateCompletionResponse"])
    reason = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = {"anyOf": [reason, {"type": "null"}]}
    defs["CompletionStreamChunk"] = chunk
    return defs


def check(name: str, instance) -> None:
    errors = [
        f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in validator(name).iter_errors(instance)
    ]
    assert not errors, f"{name} at openai-openapi {COMMIT[:12]}:\n" + "\n".join(errors)
