"""What a run costs Redis: the server's CPU time (/proc), the memory it keeps, commands per job (INFO
commandstats), and, for the map of MILI's cost, every command with its execution time (SLOWLOG)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from bench.measure import cpu_seconds
from producer_client.protocol import batch, producer, worker
from producer_client.protocol.script import Script
from worker.embedded_redis import EmbeddedRedis

HARNESS_COMMANDS = {"info", "slowlog", "config", "flushall", "ping", "hello", "client", "client|setinfo"}
SLOWLOG_MAX_LEN = 2_000_000


class RedisCosts:
    def __init__(self, server: EmbeddedRedis):
        self.server = server
        self.redis = redis.Redis.from_url(server.url, decode_responses=True)

    def cpu(self) -> float:
        return cpu_seconds(self.server.process.pid)

    def kept_memory(self) -> int:
        """`used_memory` less the clients' buffers (`mem_clients_normal`): those grow with a
        library's connections and subscriptions and go with them, they are not kept per job."""
        memory = self.redis.info("memory")
        return memory["used_memory"] - memory["mem_clients_normal"]

    def commandstats(self) -> dict[str, tuple[int, int]]:
        """Command -> (calls, microseconds) so far."""
        stats = self.redis.info("commandstats")
        return {name.removeprefix("cmdstat_"): (s["calls"], s["usec"]) for name, s in stats.items()}

    @staticmethod
    def per_job(before: dict, after: dict, jobs: int) -> dict[str, tuple[float, float]]:
        """Command -> (calls, microseconds) per job between two commandstats; this harness's own
        commands left out."""
        out = {}
        for name, (calls, usec) in after.items():
            calls0, usec0 = before.get(name, (0, 0))
            if calls > calls0 and name not in HARNESS_COMMANDS:
                out[name] = ((calls - calls0) / jobs, (usec - usec0) / jobs)
        return out

    def close(self) -> None:
        self.redis.close()


@contextmanager
def slowlog_everything(client: redis.Redis) -> Iterator[None]:
    """Every command logged with its execution time while inside, from an empty log."""
    saved = client.config_get("slowlog-*")
    client.config_set("slowlog-log-slower-than", 0)
    client.config_set("slowlog-max-len", SLOWLOG_MAX_LEN)
    client.slowlog_reset()
    try:
        yield
    finally:
        for name, value in saved.items():
            client.config_set(name, value)


def script_names() -> dict[str, str]:
    """sha1 -> name of every script of the protocol."""
    modules = (batch, producer, worker)
    return {v.sha: v.name for m in modules for v in vars(m).values() if isinstance(v, Script)}


def text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def script_costs(entries: list[dict], jobs: int) -> dict:
    """From slowlog entries: per command a client sent (an EVALSHA by its script's name), its calls
    and microseconds per job; and per script, the commands it ran, per call of it. Redis 7 logs a
    script's commands too, as the client '?:0', just before the script's own entry (a script runs
    alone), which holds their time as well; the harness's own commands are left out."""
    names = script_names()
    sent: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    inside: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    pending: list[tuple[str, int]] = []
    for entry in sorted(entries, key=lambda e: e["id"]):
        words = text(entry["command"]).split()
        name = words[0].lower()
        if text(entry.get("client_address", "")) == "?:0":
            pending.append((name, entry["duration"]))
            continue
        if name == "evalsha":
            name = f"evalsha {names.get(words[1], words[1][:10])}"
            for command, usec in pending:
                inside[name][command][0] += 1
                inside[name][command][1] += usec
        pending.clear()
        if name not in HARNESS_COMMANDS:
            sent[name][0] += 1
            sent[name][1] += entry["duration"]
    return {
        "jobs": jobs,
        "entries": len(entries),
        "complete": len(entries) < SLOWLOG_MAX_LEN,
        "per_job": {name: (calls / jobs, usec / jobs) for name, (calls, usec) in sent.items()},
        "inside": {
            script: {cmd: (n / sent[script][0], usec / sent[script][0]) for cmd, (n, usec) in commands.items()}
            for script, commands in inside.items()
        },
    }
