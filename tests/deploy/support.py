"""Helpers for the deployment tests: the repository's paths, YAML with Compose's tags, Dockerfiles."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
# The test workers' heartbeat: short, so that a dead worker's heartbeat expires within a test.
HEARTBEAT_TTL_S = 1.0
HEARTBEAT_INTERVAL_S = 0.2


class ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags (!reset, !override), kept as Tagged values."""


class Tagged:
    def __init__(self, tag: str, value):
        self.tag, self.value = tag, value


def _tagged(loader: ComposeLoader, node: yaml.Node) -> Tagged:
    if isinstance(node, yaml.MappingNode):
        value = loader.construct_mapping(node, deep=True)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_scalar(node)
    return Tagged(node.tag, value)


for _tag in ("!reset", "!override"):
    ComposeLoader.add_constructor(_tag, _tagged)


def load_compose(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def load_yaml_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def environment_without_mili() -> dict[str, str]:
    """The caller's environment minus MILI_* variables, so they cannot leak into a test."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MILI_")}


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY...
    args: str
    stage: int  # 0 for the global ARGs before the first FROM, then 1, 2...

    def exec_form(self) -> list[str]:
        """The JSON array of an exec-form CMD/ENTRYPOINT/HEALTHCHECK CMD."""
        return json.loads(self.args[self.args.index("[") :])


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions with their continuation lines joined; comment lines dropped (also inside
    a continued instruction, as Docker does)."""
    instructions: list[Instruction] = []
    stage = 0
    pending = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, args = pending.strip().partition(" ")
        pending = ""
        if keyword.upper() == "FROM":
            stage += 1
        instructions.append(Instruction(keyword.upper(), " ".join(args.split()), stage))
    return instructions


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parent directories
    decides; `!` re-includes; `*` stays within one path segment and `**` crosses them."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _dockerignore_regex(pattern.lstrip("!").rstrip("/"))
        if any(regex.fullmatch(c) for c in candidates):
            excluded = not negate
    return excluded


def _dockerignore_regex(pattern: str) -> re.Pattern:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


def read_dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def redis_server_flags(command: list[str]) -> dict[str, str]:
    """{'appendonly': 'yes', ...} from a redis-server command line `redis-server --name value ...`."""
    assert command[0] == "redis-server", command
    args = command[1:]
    assert len(args) % 2 == 0 and all(a.startswith("--") for a in args[::2]), args
    return {name[2:]: value for name, value in zip(args[::2], args[1::2])}


def compose_default(value: str) -> str:
    """`${VAR:-default}` -> default: what Compose uses when VAR is unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def volume_mounts(service: dict) -> dict[str, str]:
    """{container path: source with Compose's defaults filled in} of a service's short-syntax volumes."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *_ = compose_default(volume).split(":")
        mounts[target] = source
    return mounts


def known_mili_variables() -> set[str]:
    """Every MILI_* variable the code reads: one per setting (MILI_ENGINE__<NAME> for engine
    settings) and those that worker/ reads by name, such as MILI_CACHE_DIR."""
    from worker.engine.settings import EngineSettings
    from worker.settings import WorkerSettings

    names = {f"MILI_{name.upper()}" for name in WorkerSettings.model_fields}
    names |= {f"MILI_ENGINE__{name.upper()}" for name in EngineSettings.model_fields}
    for source in (ROOT / "worker").rglob("*.py"):
        names |= set(re.findall(r"[\"'](MILI_[A-Z_]+)[\"']", source.read_text()))
    return names


def worker_commands() -> set[str]:
    """The subcommands of `python -m worker`."""
    from worker.__main__ import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(subparsers.choices)


def tracked_files(under: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", under], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out.split()


Families = dict[str, tuple[str, set[str]]]  # {family: (type, sample names)} of one /metrics scrape


def families_at(url: str) -> Families:
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return {f.name: (f.type, {s.name for s in f.samples}) for f in text_string_to_metric_families(body)}


def exported_names(families: Families) -> set[str]:
    """The names of every sample of a scrape."""
    return {name for _, samples in families.values() for name in samples}
