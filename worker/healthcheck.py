"""`python -m worker healthcheck`: exit 0 only when Redis answers PING and this worker's
heartbeat is live; 1 otherwise (Docker reserves exit code 2, so every failure is 1 and the
reason goes to stderr, where `docker inspect` and `kubectl describe` show it).

Live means the heartbeat key `mili:worker:{name}` exists. The worker sets its TTL to
`heartbeat_ttl_s` on every beat and the TTL runs on the Redis clock, so the check needs no
clock shared between the worker and the checker: the key is there, or it has expired.

Which worker is "this" one: the `name` setting when it is set. Otherwise the worker named
itself `<hostname>-<pid>`, and the checker, another process, cannot know that pid; it takes
the workers in the queue's index whose names start with `<hostname>-`. A container or a pod
has a hostname of its own and runs one worker, so there that is exactly this worker.
"""

from __future__ import annotations

import argparse
import socket
import sys

import redis

from producer_client import steps
from producer_client.connection import describe, probe
from producer_client.errors import MiliError
from producer_client.keys import Keys
from producer_client.protocol import registry
from producer_client.settings import SETTINGS_ERRORS, settings_error_line
from worker.settings import WorkerSettings, settings_from_args


def run_healthcheck(args: argparse.Namespace) -> int:
    """The `healthcheck` subcommand: the settings the worker reads (flags, MILI_*, the TOML
    file). Settings that do not load are unhealthy too, with 1 rather than the CLI's 2."""
    try:
        settings = settings_from_args(args)
    except (MiliError, FileNotFoundError) as e:
        return _unhealthy(f"the settings do not load: {e}")
    except SETTINGS_ERRORS as e:
        return _unhealthy(f"the settings do not load: {settings_error_line(e)}")
    return healthcheck(settings)


def healthcheck(settings: WorkerSettings) -> int:
    """The process exit code: 0 healthy, 1 not; says why on stdout or stderr. Every Redis call is
    tried once, all of them within healthcheck_timeout_s: a Redis that is down or hung reads as
    unhealthy, with its cause, and not as the probe's own timeout."""
    if settings.redis == "embedded":
        return _unhealthy("an embedded Redis is private to its worker; give the worker and the check a Redis URL")
    keys = Keys(settings.prefix)

    def answers_and_live(client: redis.Redis) -> list[str]:
        client.ping()
        return live_workers(client, keys, settings.queue, settings.name)

    try:
        live = probe(settings.redis, settings.healthcheck_timeout_s, answers_and_live)
    except redis.RedisError as e:
        return _unhealthy(f"Redis does not answer: {describe(e)}")
    if not live:
        who = settings.name or f"{socket.gethostname()}-*"
        return _unhealthy(f"no live heartbeat for worker {who} on queue {settings.queue}")
    print(f"healthy: worker {', '.join(live)} has a live heartbeat")
    return 0


def live_workers(client: redis.Redis, keys: Keys, queue: str, name: str) -> list[str]:
    """This worker's name if its heartbeat key exists; with no name, every live worker of this host."""
    names = [name] if name else this_host_workers(client, keys, queue)
    alive = steps.run(client, registry.alive(keys, names))
    return [n for n, exists in zip(names, alive) if exists]


def this_host_workers(client: redis.Redis, keys: Keys, queue: str) -> list[str]:
    prefix = f"{socket.gethostname()}-"
    (names,) = steps.run(client, registry.worker_names(keys, [queue]))
    return [n for n in names if n.startswith(prefix)]


def _unhealthy(reason: str) -> int:
    print(f"unhealthy: {reason}", file=sys.stderr)
    return 1
