"""How large a regex is once its counted repetitions are unrolled, and the patterns of a format
too large for the worker to follow.

The grammar library builds its lexer by derivatives, and a counted repetition costs it as many
states as it counts: each mask the worker computes for a job held to `a{100000}` took 12 s over
Qwen3's vocabulary (the cost grows with the square of the count: `a{1000}` 1 ms, `a{10000}`
0.1 s), and every step of the worker's batch waits for the masks. One such job stalled a worker,
and every job on it, for minutes. The library's own limits (its lexer fuel) do not count this
cost, and compiling over the client's byte vocabulary is quick: the size is counted here instead.
The count is the pattern's atoms with each repetition `{m}`, `{m,}`, `{m,n}` multiplying what it
repeats by its larger bound (nested ones multiply), `*`, `+` and `?` by one; `x{5000}y{5000}`
costs what `a{10000}` does.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

# About 4 ms a mask at most over Qwen3's vocabulary; `[0-9a-f]{8}-...-[0-9a-f]{12}` (a UUID) is 40.
MAX_UNROLLED = 2000
COUNTED = re.compile(r"\{(\d+)(?:,(\d*))?\}")
# The keywords of a JSON schema whose values are data, not schemas: a `pattern` key there is no regex.
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def unrolled_size(pattern: str) -> int:
    """The atoms of `pattern` once its counted repetitions are unrolled (see the module)."""
    # One entry per open group: [its size so far, the size of its last atom].
    groups: list[list[int]] = [[0, 0]]
    i = 0
    while i < len(pattern):
        char = pattern[i]
        counted = COUNTED.match(pattern, i) if char == "{" else None
        if counted is not None:
            low, high = counted.groups()
            times = int(high) if high else int(low)
            top = groups[-1]
            top[0] += top[1] * (times - 1)
            top[1] *= times
            i = counted.end()
            continue
        if char == "(":
            groups.append([0, 0])
            i = group_body(pattern, i + 1)
            continue
        if char == ")" and len(groups) > 1:
            atom = groups.pop()[0]
            i += 1
        elif char in "*+?|^$":
            i += 1
            continue
        elif char == "\\":
            atom, i = 1, escape_end(pattern, i)
        elif char == "[":
            atom, i = 1, class_end(pattern, i)
        else:
            atom, i = 1, i + 1
        groups[-1][0] += atom
        groups[-1][1] = atom
    return sum(size for size, _ in groups)


def group_body(pattern: str, i: int) -> int:
    """Where a group's body begins, past `?:`, `?P<name>`, `?<name>` or flags `?i:`."""
    if not pattern.startswith("?", i):
        return i
    i += 1
    while i < len(pattern) and pattern[i] not in ":>)":
        i += 1
    return i + 1 if i < len(pattern) and pattern[i] in ":>" else i


def escape_end(pattern: str, i: int) -> int:
    """Past the escape at `i`: `\\d`, or one with braces, `\\p{Greek}`, `\\x{263a}`."""
    end = i + 2
    if pattern.startswith("{", end):
        close = pattern.find("}", end)
        return len(pattern) if close < 0 else close + 1
    return end


def class_end(pattern: str, i: int) -> int:
    """Past the character class at `i`, nested classes (`[a-z&&[^x]]`) and escapes in it."""
    depth, start = 0, i
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i = escape_end(pattern, i)
            continue
        if char == "[":
            depth += 1
        elif char == "]" and i > start + 1 and not (i == start + 2 and pattern[start + 1] == "^"):
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def oversized(pattern: str) -> str | None:
    """Why `pattern` is too large for the worker to follow, or None."""
    size = unrolled_size(pattern)
    if size <= MAX_UNROLLED:
        return None
    return (
        f"the regex is {size} atoms long with its counted repetitions unrolled (nested ones multiplied), over "
        f"{MAX_UNROLLED}: the grammar library builds a lexer state for each, and every step of the worker would "
        "wait on them"
    )


def schema_patterns(schema: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str]]:
    """Every regex of a JSON schema with its path: `pattern` values and `patternProperties` keys."""
    if isinstance(schema, list):
        for n, item in enumerate(schema):
            yield from schema_patterns(item, (*path, str(n)))
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            yield (*path, key), value
        elif key == "patternProperties" and isinstance(value, dict):
            for name, sub in value.items():
                yield (*path, key, name), name
                yield from schema_patterns(sub, (*path, key, name))
        elif key not in DATA_KEYWORDS:
            yield from schema_patterns(value, (*path, key))
