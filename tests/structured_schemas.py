"""JSON schemas for the structured outputs' property tests: objects with `required` keys and no
others, arrays with item bounds, enums, integer bounds, booleans, nulls, and strings bounded by
length or by a pattern, nested two levels deep.

Every string, number and array is bounded, and no property can be added: a random model (whose
preferences are noise) then closes its JSON within MAX_TOKENS, so every output must end by its
grammar and validate, and none is excused by `length`. (Unbounded strings, and JSON numbers,
whose fraction has no end, would let a random model write on past any budget.)

hypothesis-jsonschema, which the issue named for drawing schemas from a meta-schema, cannot draw
an object under the hypothesis this project runs (0.23.1, its latest, calls `many.more()`, which
hypothesis 6.170 no longer has): these are hypothesis' own strategies.
"""

from __future__ import annotations

import json
import string
from typing import Any

from hypothesis import strategies as st

MAX_TOKENS = 320
NAMES = ["id", "name", "count", "kind", "tags", "note"]
PATTERNS = ["^[a-z]{1,6}$", "^[0-9]{3}-[0-9]{2}$", "^(red|green|blue)$", "^[A-Z][a-z]{0,4}$"]


def closed(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


LEAVES = st.one_of(
    st.integers(0, 8).map(lambda n: {"type": "string", "maxLength": n}),
    st.sampled_from(PATTERNS).map(lambda p: {"type": "string", "pattern": p}),
    st.builds(
        lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi}, st.integers(-500, 0), st.integers(0, 500)
    ),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}]),
    st.lists(
        st.one_of(st.text(string.ascii_lowercase, max_size=6), st.integers(-99, 99), st.booleans()),
        min_size=1,
        max_size=4,
        unique_by=json.dumps,
    ).map(lambda values: {"enum": values}),
)


def objects(children: st.SearchStrategy) -> st.SearchStrategy[dict[str, Any]]:
    # Every property required, half the time: else a random model often closes the object at once.
    return st.dictionaries(st.sampled_from(NAMES), children, min_size=1, max_size=3).flatmap(
        lambda props: st.one_of(st.just(sorted(props)), st.lists(st.sampled_from(sorted(props)), unique=True)).map(
            lambda required: closed(props, required)
        )
    )


def arrays(children: st.SearchStrategy) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(
        lambda items, least, most: {"type": "array", "items": items, "minItems": least, "maxItems": max(least, most)},
        children,
        st.integers(0, 1),
        st.integers(1, 3),
    )


NESTED = st.one_of(LEAVES, objects(LEAVES), arrays(LEAVES))
SCHEMAS = st.one_of(objects(NESTED), arrays(NESTED))
