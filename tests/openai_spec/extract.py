"""Writes schemas.json: the component schemas of OpenAI's OpenAPI spec that MILI's responses (and
the requests its tests send) are checked against, with every schema they refer to.

    python tests/openai_spec/extract.py PATH/TO/openai-openapi/openapi.json COMMIT > tests/openai_spec/schemas.json

Descriptions are left out of the schemas; the few that state a rule a schema cannot (when a field
is present at all, what a value means) are kept whole under `texts`, by their JSON pointer, so that
the tests enforcing each rule read it from the spec they validate against.

The spec is OpenAPI 3.1 but still marks some fields `nullable: true` (OpenAPI 3.0's way), which
JSON Schema ignores: such a schema is rewritten to also take null, as the spec means it. Refs
become `#/$defs/NAME`, so the file is one JSON Schema document of definitions.
"""

import json
import sys

ROOTS = (
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "CreateChatCompletionRequest",
    "CreateCompletionRequest",
    "ListModelsResponse",
    "Model",
    "ErrorResponse",
    "OpenAIFile",
    "ListFilesResponse",
    "DeleteFileResponse",
    "Batch",
    "ListBatchesResponse",
)
# The descriptions that state a rule the tests enforce (tests/gateway/test_spec.py quotes each).
TEXTS = (
    # `usage` in a chat stream's chunks: absent unless include_usage, then null but in the last.
    "/components/schemas/CreateChatCompletionStreamResponse/properties/usage/description",
    "/components/schemas/ChatCompletionStreamOptions/anyOf/0/properties/include_usage/description",
    # `fast` asks for what `priority` does, and the answer says `priority`.
    "/components/schemas/ServiceTier/anyOf/0/description",
)
PREFIX = "#/components/schemas/"


def refs_in(node) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"][len(PREFIX) :]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(refs_in(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(refs_in(v) for v in node))
    return set()


def rewritten(node):
    if isinstance(node, list):
        return [rewritten(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: rewritten(v) for k, v in node.items() if k not in ("description", "example", "x-oaiMeta", "nullable")}
    if "$ref" in out:
        out["$ref"] = "#/$defs/" + out["$ref"][len(PREFIX) :]
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


def at_pointer(document, pointer: str):
    for part in pointer.split("/")[1:]:
        document = document[int(part) if isinstance(document, list) else part]
    return document


def main(spec_path: str, commit: str) -> None:
    spec = json.load(open(spec_path))
    schemas = spec["components"]["schemas"]
    wanted, todo = set(), list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo += refs_in(schemas[name])
    document = {
        "source": "https://github.com/openai/openai-openapi/blob/" + commit + "/openapi.json",
        "commit": commit,
        "$defs": {name: rewritten(schemas[name]) for name in sorted(wanted)},
        "texts": {pointer: at_pointer(spec, pointer) for pointer in TEXTS},
    }
    json.dump(document, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
