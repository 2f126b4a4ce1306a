"""What each script of a 1-token job costs redis-server, phase by phase, without the load's noise
(issue 43: Redis CPU per job): on a fresh embedded redis-server, `--jobs` jobs placed on a worker's
own stream go through the protocol's scripts as bench.peers' load sends them, each phase measured
alone: the producer's ENQUEUE (one call a job), the worker's READ of its own stream, CLAIM_MANY
and the final PUBLISH_ROUND (one call per `--batch` jobs each), and the deletion of the jobs' done
streams that the worker sends DONE_TTL_MS later (`forget`: as a round of `--batch` ends sends it). Per phase and per job: the
redis-server's instructions (`--callgrind`: the server runs under valgrind's callgrind, every
instruction it executes while the phase runs, its network reads and replies included; the same
code gives the same count within a few percent, where CPU time under other work moves by a
third), else its EVALSHA microseconds (INFO commandstats), and the microseconds of the commands
the scripts ran (counted under their own names too).

With `--wait`, each cycle is followed by one of the job's whole path as `generate()` and the worker
send it, measured the same way: `submit`, each job's HSETNX, XADD and XREAD BLOCK of its `done`
stream in one round trip on a connection of its own (the read blocks); READ, CLAIM_MANY; the
PUBLISH_ROUND that ends the jobs, which now also wakes each job's blocked read and writes its
reply; `settle`, the XACK and XDEL of the batch's entries (sent first in the worker's next READ
pipeline); `forget`. Beside it, what the blocked reads cost: `submit` against the first cycle's
HSETNX (`create`) and XADD (`enqueue`) in round trips of their own, and PUBLISH_ROUND with the
readers against without.

With `--before TREE` (a checkout of another commit), the trees alternate, each run in a process of
its own started there, as bench.redis_cpu does (`--wait` only where both trees have it).

    python -m bench.lua_costs [--callgrind] [--batch 6 --jobs 1200 --cycles 3] [--wait] [--before /tmp/base]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("enqueue", "read", "claim_many", "publish_round", "forget")
WHOLE_PHASES = ("submit", "read", "claim_many", "publish_round", "settle", "forget")
BLOCK_MS = 600_000  # a waiting reader's block: far past any cycle, valgrind's included
BODY = json.dumps({"prompt": "hello world, job 00-000005", "params": {"max_tokens": 1, "temperature": 0.0}})
QUEUE, WORKER = "bench", "w0"
RESULT_PAD = "y" * 250  # a 1-token job's result JSON is about 400 bytes


class Server:
    """A redis-server of the tree on sys.path's EmbeddedRedis, its counters read per phase."""

    def __init__(self, url: str, pid: int, callgrind: Path | None):
        import redis

        self.redis = redis.Redis.from_url(url, decode_responses=True)
        self.pid, self.callgrind = pid, callgrind
        if callgrind:
            self.redis.config_set("hz", 1)  # fewer cron runs in a phase that valgrind makes long

    def phase(self, pipelines: list[Callable[[Any], None]], jobs: int) -> tuple[dict, list]:
        """Runs each of `pipelines` as one round trip; returns the phase's figures per job and the replies."""
        replies: list = []

        def run() -> None:
            for add in pipelines:
                pipe = self.redis.pipeline(transaction=False)
                add(pipe)
                replies.append(pipe.execute())

        return self.counted(run, jobs), replies

    def reader(self) -> Any:
        """A connection of its own to the server, outside the client's pool (a job's waiting producer)."""
        import redis

        connection = redis.Connection(**self.redis.connection_pool.connection_kwargs)
        connection.connect()  # its handshake (HELLO) before any phase counts
        return connection

    def counted(self, run: Callable[[], None], jobs: int) -> dict:
        """The figures per job of what `run` makes the server do."""
        self.redis.config_resetstat()
        if self.callgrind:
            subprocess.run(["callgrind_control", "-z", str(self.pid)], capture_output=True, check=True)
        run()
        if self.callgrind:
            subprocess.run(["callgrind_control", "-d", str(self.pid)], capture_output=True, check=True)
        stats = {k.removeprefix("cmdstat_"): v for k, v in self.redis.info("commandstats").items()}
        stats.pop("config|resetstat", None)
        evalsha = stats.pop("evalsha", {"usec": 0})["usec"]
        figures = {
            "evalsha_us": evalsha / jobs,
            "commands_us": sum(s["usec"] for s in stats.values()) / jobs,
            "commands": {name: s["calls"] / jobs for name, s in stats.items()},
        }
        if self.callgrind:
            figures["kinstr"] = self.instructions() / jobs / 1000
        return figures

    def instructions(self) -> int:
        """The last callgrind dump's total: the instructions since the zeroing before it."""
        assert self.callgrind is not None
        dumps = sorted(self.callgrind.glob(f"cg.{self.pid}.*"), key=lambda p: int(p.suffix[1:]))
        totals = re.search(r"^totals: (\d+)", dumps[-1].read_text(), re.M)
        assert totals, f"no totals in {dumps[-1]}"
        return int(totals.group(1))


def one_cycle(server: Server, jobs: int, batch: int) -> dict[str, dict]:
    """`jobs` jobs through the four phases; each phase's figures."""
    from producer_client.keys import Keys
    from producer_client.protocol import consumer, producer

    keys = Keys()
    own = keys.own_queue(QUEUE, WORKER)
    ids = [uuid.uuid4().hex for _ in range(jobs)]
    out = {}
    out["create"], _ = server.phase(
        [functools.partial(producer.add_fresh_create, keys=keys, job_id=j, timeout_ms=0) for j in ids], jobs
    )
    out["enqueue"], _ = server.phase([call.add_to for call in placed_entries(producer, own, ids)], jobs)
    chunks = serve(server, keys, own, jobs, batch, out)
    pipe = server.redis.pipeline(transaction=False)
    consumer.add_settled(pipe, own, [e for c in chunks for e, _ in c])  # as the worker's next read does
    pipe.execute()
    out["forget"], _ = server.phase([functools.partial(forget_done, keys, [j for _, j in c]) for c in chunks], jobs)
    return out


def whole_cycle(server: Server, jobs: int, batch: int) -> dict[str, dict]:
    """`jobs` jobs through their whole path (WHOLE_PHASES), each job's submit and wait on a
    connection of its own, as `generate()` sends them; each phase's figures."""
    from producer_client.keys import Keys
    from producer_client.protocol import consumer, job_reads, producer

    keys = Keys()
    own = keys.own_queue(QUEUE, WORKER)
    ids = [uuid.uuid4().hex for _ in range(jobs)]
    readers = [server.reader() for _ in ids]

    def submit() -> None:
        for reader, job_id in zip(readers, ids):
            pipe = server.redis.pipeline(transaction=False)
            producer.add_fresh_create(pipe, keys, job_id, 0)
            producer.PlacedEntry(own, job_id, BODY, {"cost": "8"}).add_to(pipe)
            job_reads.add_ends_read(pipe, (keys.done(job_id),), BLOCK_MS)
            reader.send_packed_command(reader.pack_commands([args for args, _ in pipe.command_stack]))
            reader.read_response(), reader.read_response()  # the create's and the XADD's; the read blocks

    out = {"submit": server.counted(submit, jobs)}
    chunks = serve(server, keys, own, jobs, batch, out)
    woken = [reader.read_response() for reader in readers]
    assert all(woken), woken  # each read woke with its job's end (None: its block ran out)
    for reader in readers:
        reader.disconnect()
    settled = [functools.partial(consumer.add_settled, stream=own, entry_ids=[e for e, _ in c]) for c in chunks]
    out["settle"], _ = server.phase(settled, jobs)
    out["forget"], _ = server.phase([functools.partial(forget_done, keys, [j for _, j in c]) for c in chunks], jobs)
    return out


def serve(server: Server, keys: Any, own: str, jobs: int, batch: int, out: dict[str, dict]) -> list[list[tuple]]:
    """A worker's part of `jobs` 1-token jobs queued on `own`: its READs of `batch` entries, their
    CLAIM_MANY and the PUBLISH_ROUND that ends them, each phase's figures put in `out`; returns the
    (entry id, job id) pairs read, a chunk a READ."""
    from producer_client.protocol import worker

    read = worker.read(keys, QUEUE, WORKER, (256, 255, 16), 320, {}, (own, batch))
    out["read"], replies = server.phase([read.add_to] * (jobs // batch), jobs)
    entries = [(e[0], dict(zip(e[1][::2], e[1][1::2]))["id"]) for (r,) in replies for _, _, es in r for e in es]
    runs = {job_id: f"run:{i}" for i, (_, job_id) in enumerate(entries)}
    chunks = [entries[at : at + batch] for at in range(0, len(entries), batch)]
    claims = [worker.claim_many(keys, WORKER, 3600, [(j, f"{e}@{WORKER}", runs[j]) for e, j in c]) for c in chunks]
    out["claim_many"], _ = server.phase([call.add_to for call in claims], jobs)
    rounds = [worker.publish_round([final_publish(keys, job_id, runs[job_id]) for _, job_id in c]) for c in chunks]
    out["publish_round"], replies = server.phase([call.add_to for call in rounds], jobs)
    assert all(reply == "written" for (r,) in replies for reply in r), replies[0]
    return chunks


def forget_done(keys: Any, job_ids: list[str], pipe: Any) -> None:
    """The UNLINKs of `job_ids`' done streams that a worker's round sends, as the tree being measured
    sends them: one of them all where its forget_done takes them all, else (older trees) one a job."""
    from producer_client.protocol import worker

    if hasattr(worker, "add_unlink"):
        for unlink in worker.forget_done(keys, job_ids, one_server=True):
            worker.add_unlink(pipe, unlink)
    else:
        for job_id in job_ids:
            worker.forget_done(pipe, keys, job_id)


def final_publish(keys: Any, job_id: str, run: str) -> Any:
    """A 1-token job's only PUBLISH: its start, its token and its result, as an echo worker's."""
    from producer_client.protocol import worker

    start = json.dumps({"worker": WORKER, "started_at": 1795961456.0340335, "resumed_tokens": 0})
    result = json.dumps({"id": job_id, "status": "done", "text": "h", "token_ids": [104], "pad": RESULT_PAD})
    return worker.publish(keys, job_id, run, start, '{"ids":[104],"text":"h"}', 0, 1, "done", result, 3600)


def one_run(jobs: int, batch: int, cycles: int, callgrind: str, wait: bool = False) -> dict:
    """A warm-up cycle, then `cycles` measured ones, on a fresh server; each figure's median. With
    `wait`, each measured cycle is followed by a whole_cycle, its phases named `whole:<phase>`."""
    from producer_client.keys import Keys
    from producer_client.protocol import consumer, execution, worker
    from worker.embedded_redis import EmbeddedRedis, free_port

    with EmbeddedRedis(port=free_port()) as embedded:
        assert embedded.process is not None
        server = Server(embedded.url, embedded.process.pid, Path(callgrind) if callgrind else None)
        execution.load_scripts(server.redis, worker.WORKER_SCRIPTS)
        consumer.create_group(server.redis, Keys().queue(QUEUE), make_stream=True)
        consumer.create_group(server.redis, Keys().own_queue(QUEUE, WORKER), make_stream=True)
        one_cycle(server, jobs, batch)
        measured = []
        for _ in range(cycles):
            cycle = one_cycle(server, jobs, batch)
            if wait:
                cycle |= {f"whole:{phase}": figures for phase, figures in whole_cycle(server, jobs, batch).items()}
            measured.append(cycle)
    return {
        phase: {
            **{f: statistics.median(c[phase][f] for c in measured) for f in measured[0][phase] if f != "commands"},
            "commands": measured[-1][phase]["commands"],
        }
        for phase in measured[0]
    }


def placed_entries(producer: Any, own: str, ids: list[str]) -> list[Any]:
    """A producer's call adding each job to the worker stream `own`, as the tree being measured makes
    it: a plain XADD (PlacedEntry) where the tree has one, else (older trees) the ENQUEUE script with
    no bound."""
    if hasattr(producer, "PlacedEntry"):
        return [producer.PlacedEntry(own, job_id, BODY, {"cost": "8"}) for job_id in ids]
    return [producer.enqueue(own, 0, job_id, BODY, {"cost": "8"}) for job_id in ids]


def run_in(tree: Path, args: argparse.Namespace, wrapper: Path | None) -> dict:
    """one_run of `tree`'s code in a process of its own started there; with `wrapper`, the
    redis-server it starts is that one (callgrind's)."""
    from bench.measure import one_run_in  # here: this file also runs in older trees, that lack it

    call = f"{args.jobs}, {args.batch}, {args.cycles}, {str(wrapper.parent) if wrapper else ''!r}"
    call += ", wait=True" if args.wait else ""
    env = {"PATH": f"{wrapper.parent}:{os.environ['PATH']}"} if wrapper else None
    return one_run_in(tree, str(Path(__file__)), call, env)


def callgrind_wrapper(folder: Path) -> Path:
    """A `redis-server` that runs the real one under callgrind, its dumps in `folder`."""
    real = shutil.which("redis-server")
    if not real or not shutil.which("valgrind"):
        raise SystemExit("--callgrind needs redis-server and valgrind on PATH")
    wrapper = folder / "redis-server"
    wrapper.write_text(
        f'#!/bin/sh\nexec valgrind --tool=callgrind --callgrind-out-file={folder}/cg.%p {real} "$@" 2>/dev/null\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=1200, help="jobs a cycle (600 is plenty under --callgrind)")
    p.add_argument("--batch", type=int, default=6, help="jobs a READ, CLAIM_MANY and PUBLISH_ROUND call")
    p.add_argument("--cycles", type=int, default=3, help="measured cycles a run, after one to warm up")
    p.add_argument("--rounds", type=int, default=1, help="runs of each tree")
    p.add_argument("--callgrind", action="store_true", help="count redis-server's instructions (valgrind)")
    p.add_argument(
        "--wait", action="store_true", help="also each job's whole path, its blocked read of `done` included"
    )
    p.add_argument("--before", type=Path, help="a tree of the code to compare with, run in alternation")
    args = p.parse_args()
    trees = {"before": args.before, "after": ROOT} if args.before else {"this": ROOT}
    with tempfile.TemporaryDirectory(prefix="mili-lua-") as folder:
        wrapper = callgrind_wrapper(Path(folder)) if args.callgrind else None
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(run_in(tree, args, wrapper))
    figure = "kinstr" if args.callgrind else "evalsha_us"
    print_table(runs, figure)
    if args.wait:
        print_whole(runs, figure)


def print_whole(runs: dict[str, list[dict]], figure: str) -> None:
    """The whole path's table (--wait), and what the blocked reads add: the submit's pipeline against
    its create and XADD sent alone, PUBLISH_ROUND waking them against the same with no reader."""
    print(f"\n| the whole path (--wait) | {' | '.join(runs)} |\n|---|" + "---|" * len(runs))

    def cell(figures: list[dict], phase: str) -> float:
        return statistics.median(r[phase][figure] for r in figures)

    for phase in WHOLE_PHASES:
        print(f"| {phase} | " + " | ".join(f"{cell(f, 'whole:' + phase):.2f}" for f in runs.values()) + " |")
    totals = [sum(cell(f, "whole:" + phase) for phase in WHOLE_PHASES) for f in runs.values()]
    print("| all | " + " | ".join(f"{total:.2f}" for total in totals) + " |")
    alone = [cell(f, "create") + cell(f, "enqueue") for f in runs.values()]
    print("| create + enqueue, round trips of their own | " + " | ".join(f"{a:.2f}" for a in alone) + " |")
    print("| publish_round, no reader | " + " | ".join(f"{cell(f, 'publish_round'):.2f}" for f in runs.values()) + " |")
    for phase in ("submit", "settle"):
        for name, figures in runs.items():
            commands = ", ".join(f"{c} {n:.2f}" for c, n in sorted(figures[-1][f"whole:{phase}"]["commands"].items()))
            print(f"{phase} ({name}), commands a job: {commands}")


def print_table(runs: dict[str, list[dict]], figure: str) -> None:
    # valgrind slows every command alike: under it, microseconds say nothing
    unit = "redis-server's thousand instructions" if figure == "kinstr" else "EVALSHA us / its commands' us"
    print("| phase | " + " | ".join(f"{name}: {unit}, a job" for name in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for phase in PHASES:
        cells = [
            f"{statistics.median(r[phase][figure] for r in figures):.2f}"
            + ("" if figure == "kinstr" else f" / {statistics.median(r[phase]['commands_us'] for r in figures):.2f}")
            for figures in runs.values()
        ]
        print(f"| {phase} | " + " | ".join(cells) + " |")
    totals = [
        sum(statistics.median(r[phase][figure] for r in figures) for phase in PHASES) for figures in runs.values()
    ]
    print("| all | " + " | ".join(f"{total:.2f}" for total in totals) + " |")
    for phase in PHASES:
        for name, figures in runs.items():
            commands = ", ".join(f"{c} {n:.2f}" for c, n in sorted(figures[-1][phase]["commands"].items()))
            print(f"{phase} ({name}), commands a job: {commands}")


if __name__ == "__main__":
    main()
