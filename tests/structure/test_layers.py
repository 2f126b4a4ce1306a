"""The code base's layering, read from its imports: the client library and wire models at the
bottom, OpenAI's format over the client library, the gateway beside the worker service on top
of them, the `mili` CLI a front end over the client library and OpenAI's format, the engine and
the model below the service, the kernels at the ground. No import runs the wrong way, nothing of
ours imports the CLI, the CLI never imports the gateway, OpenAI's format imports no web framework,
and no two modules import each other (not even for type hints only). Beside the shipped packages,
the harness serves the tests and the benchmarks: the benchmarks and the harness never import the
tests, and nothing shipped imports any of the three. And every Redis command on MILI's keys is
built in producer_client/protocol/: no other module calls a Redis command's method itself."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("producer_client", "openai_format", "gateway", "worker", "kernels", "cli")
# A layer may import its own modules and those of the layers listed for it, nothing else of ours.
MAY_IMPORT = {
    "kernels": set(),
    "producer_client": set(),
    "worker.model": {"kernels", "producer_client"},
    "worker.engine": {"worker.model", "kernels", "producer_client"},
    "worker": {"worker.engine", "worker.model", "kernels", "producer_client"},
    # OpenAI's requests, responses, errors and batch lines: what the gateway serves over HTTP and
    # `mili batch` over local files, so that the plain install (no web stack) runs `mili batch`.
    "openai_format": {"producer_client"},
    "gateway": {"producer_client", "openai_format"},
    "cli": {"producer_client", "openai_format"},
}
# The web stack is the gateway extra's: what the plain install runs (the CLI and what it imports)
# never imports it, at any depth.
WEB_STACK = {"fastapi", "starlette", "uvicorn"}
NEVER_IMPORTS = {"openai_format": WEB_STACK, "cli": WEB_STACK}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Our modules that `path` imports, at any depth of its code (type-checking blocks too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def top_level_imports(path: Path) -> set[str]:
    """The top-level names of every package `path` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def layer_of(module: str) -> str:
    return next(
        layer
        for layer in sorted(MAY_IMPORT, key=len, reverse=True)
        if module == layer or module.startswith(layer + ".")
    )


def test_no_import_runs_against_the_layering():
    known = modules()
    wrong = []
    for module, path in known.items():
        layer = layer_of(module)
        for target in imports_of(path, set(known)):
            target_layer = layer_of(target)
            if target_layer != layer and target_layer not in MAY_IMPORT[layer]:
                wrong.append(f"{module} ({layer}) imports {target} ({target_layer})")
    assert wrong == []


def test_what_the_plain_install_runs_imports_no_web_framework():
    checked = {module: path for module, path in modules().items() if layer_of(module) in NEVER_IMPORTS}
    assert {layer_of(module) for module in checked} == set(NEVER_IMPORTS)
    wrong = [
        f"{module} imports {name}"
        for module, path in checked.items()
        for name in sorted(top_level_imports(path) & NEVER_IMPORTS[layer_of(module)])
    ]
    assert wrong == []


def test_no_two_modules_import_each_other_even_for_type_hints():
    known = modules()
    # A module's own parent packages run before it anyway: `from producer_client import protocol`
    # in producer_client/client.py is no cycle through producer_client/__init__.py.
    graph = {
        module: {target for target in imports_of(path, set(known)) if not module.startswith(target + ".")} - {module}
        for module, path in known.items()
    }
    cycles = set()
    for start in graph:
        stack = [(start, (start,))]
        seen = set()
        while stack:
            module, route = stack.pop()
            for target in graph[module]:
                if target == start:
                    cycles.add(" -> ".join(sorted(route)))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, route + (target,)))
    assert sorted(cycles) == []


# Run from a checkout, never shipped: what each may not import, at any depth of its code.
UNSHIPPED_NEVER_IMPORTS = {"bench": {"tests"}, "harness": {"tests", "bench"}}


def test_the_benchmarks_and_the_harness_never_import_the_tests():
    wrong = [
        f"{path.relative_to(ROOT)} imports {name}"
        for folder, forbidden in UNSHIPPED_NEVER_IMPORTS.items()
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in sorted(top_level_imports(path) & forbidden)
    ]
    assert wrong == []


def test_nothing_shipped_imports_the_tests_the_benchmarks_or_the_harness():
    wrong = [
        f"{module} imports {name}"
        for module, path in modules().items()
        for name in sorted(top_level_imports(path) & {"tests", "bench", *UNSHIPPED_NEVER_IMPORTS})
    ]
    assert wrong == []


# Redis's commands on keys, as redis-py's methods name them: the ones MILI sends on its keys.
REDIS_COMMANDS = set(
    "xadd xread xreadgroup hset hsetnx hget hgetall hmget expire pexpire delete unlink zadd zrange zrem xack "
    "xautoclaim eval evalsha incr xlen xrange xrevrange xpending sadd smembers exists".split()
)
# Calls of those names that are no Redis command, by their receiver: a web route's method, a
# model's eval mode, a file's unlink or existence.
NOT_REDIS = {
    ("router", "delete"),
    ("model", "eval"),
    ("head", "eval"),
    ("temp", "unlink"),
    ("path", "exists"),
    ("path / name", "exists"),
    ("config_path", "exists"),
    ("log_file", "exists"),
}


def test_every_command_on_mili_keys_is_built_in_the_protocol_package():
    """producer_client/protocol/ builds every command sent on MILI's keys (docs/development.md,
    "Who owns what"): the clients, the worker, the gateway and the CLI call its functions, and
    none sends a command of its own."""
    wrong = []
    for module, path in modules().items():
        if module.startswith("producer_client.protocol") or layer_of(module) == "kernels":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                call = (ast.unparse(node.func.value), node.func.attr)
                if call[1] in REDIS_COMMANDS and call not in NOT_REDIS:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {call[0]}.{call[1]}(...)")
    assert wrong == []
