"""The operator's commands of `mili`: dead letters, live workers, and the jobs a queue holds.

    mili dead list [--limit N] | mili dead show ID
    mili dead retry ID|--all | mili dead purge ID|--all|--older-than DURATION
    mili workers
    mili jobs --status queued|running|dead [--limit N]

ID is a dead letter's entry id (the first column of `mili dead list`) or a job id. DURATION is a
number with a unit: 90s, 15m, 12h, 7d.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from datetime import datetime, timezone

from producer_client.client import Client
from producer_client.dead_letters import DeadLetter, Retried
from producer_client.errors import InvalidArgument
from producer_client.inspection import RunningJob, WaitingJob, WorkerHealth
from producer_client.validation import DEFAULT_LIMIT

DURATION = re.compile(r"([-+]?\d+(?:\.\d+)?)([smhd])")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# Statuses that have an index to list them from; the others exist only as each job's own keys.
LISTABLE = ("queued", "running", "dead")
UNLISTABLE = ("done", "failed", "cancelled", "expired")


def add_commands(commands) -> None:
    """Add `dead`, `workers` and `jobs` to the `mili` parser's subcommands."""
    dead = commands.add_parser("dead", help="the queue's dead letters: list, show, retry, purge")
    actions = dead.add_subparsers(dest="dead_command", required=True)
    listing = actions.add_parser("list", help="the newest dead letters")
    listing.add_argument("--limit", type=int, default=DEFAULT_LIMIT)
    listing.set_defaults(run=cmd_dead_list)
    show = actions.add_parser("show", help="one dead letter as JSON, with the job's body")
    show.add_argument("id", help="a dead letter's entry id, or a job id")
    show.set_defaults(run=cmd_dead_show)
    retry = actions.add_parser("retry", help="enqueue dead-lettered jobs again, under their job ids")
    retry.add_argument("id", nargs="?", help="a dead letter's entry id, or a job id")
    retry.add_argument("--all", action="store_true", help="every dead letter of the queue")
    retry.set_defaults(run=cmd_dead_retry)
    purge = actions.add_parser("purge", help="remove dead letters")
    purge.add_argument("id", nargs="?", help="a dead letter's entry id, or a job id")
    purge.add_argument("--all", action="store_true", help="every dead letter of the queue")
    purge.add_argument(
        "--older-than", metavar="DURATION", help="letters that died longer ago than this: 90s, 15m, 12h, 7d"
    )
    purge.set_defaults(run=cmd_dead_purge)

    commands.add_parser("workers", help="live workers of every queue, from their heartbeats").set_defaults(
        run=cmd_workers
    )
    jobs = commands.add_parser("jobs", help="jobs the queue holds: queued, running or dead")
    jobs.add_argument("--status", required=True, help=f"one of {', '.join(LISTABLE)}")
    jobs.add_argument("--limit", type=int, default=DEFAULT_LIMIT)
    jobs.set_defaults(run=cmd_jobs)


def cmd_dead_list(client: Client, args: argparse.Namespace) -> int:
    print_letters(client.dead_letters.list(args.limit))
    return 0


def cmd_dead_show(client: Client, args: argparse.Namespace) -> int:
    print(client.dead_letters.get(args.id).model_dump_json(indent=2))
    return 0


def cmd_dead_retry(client: Client, args: argparse.Namespace) -> int:
    one_target(args, ("id", "all"))
    outcomes = client.dead_letters.retry_all() if args.all else [client.dead_letters.retry(args.id)]
    print_retries(outcomes)
    return 0


def cmd_dead_purge(client: Client, args: argparse.Namespace) -> int:
    one_target(args, ("id", "all", "older_than"))
    if args.id is not None:
        letter = client.dead_letters.purge(args.id)
        print(f"purged dead letter {letter.letter_id} of job {letter.job_id}")
        return 0
    removed = (
        client.dead_letters.purge_all()
        if args.all
        else client.dead_letters.purge_older_than(parse_duration(args.older_than))
    )
    print(f"purged {removed} dead letters")
    return 0


def cmd_workers(client: Client, args: argparse.Namespace) -> int:
    print_workers([w for w in client.inspect.workers() if w.condition != "gone"])
    return 0


def cmd_jobs(client: Client, args: argparse.Namespace) -> int:
    status = check_listable(args.status)
    limit = args.limit
    if status == "queued":
        print_waiting(client.inspect.waiting(limit))
    elif status == "running":
        print_running(client.inspect.running(limit))
    else:
        print_letters(client.dead_letters.list(limit))
    return 0


def one_target(args: argparse.Namespace, names: Sequence[str]) -> None:
    given = [name for name in names if getattr(args, name) not in (None, False)]
    if len(given) != 1:
        spelled = " or ".join("ID" if n == "id" else "--" + n.replace("_", "-") for n in names)
        raise InvalidArgument("id", f"give exactly one of {spelled}")


def check_listable(status: str) -> str:
    if status in UNLISTABLE:
        raise InvalidArgument(
            "status",
            f"{status} jobs cannot be listed: ended jobs have no index, only their own keys "
            f"(mili status ID finds one); listable: {', '.join(LISTABLE)}",
        )
    if status not in LISTABLE:
        raise InvalidArgument("status", f"must be one of {', '.join(LISTABLE)}")
    return status


def parse_duration(text: str) -> float:
    match = DURATION.fullmatch(text.strip())
    if not match:
        raise InvalidArgument("older_than", f"{text!r} is not a duration such as 90s, 15m, 12h or 7d")
    if float(match.group(1)) <= 0:
        raise InvalidArgument("older_than", f"{text!r} is not a duration: it must be positive, such as 90s or 7d")
    return float(match.group(1)) * UNIT_S[match.group(2)]


# -- tables ---------------------------------------------------------------------------------------


def print_letters(letters: list[DeadLetter]) -> None:
    print_table(
        ("LETTER", "JOB", "DELIVERIES", "WORKER", "DIED", "REASON"),
        [(d.letter_id, d.job_id, d.deliveries, d.worker, utc(d.dead_at), d.reason) for d in letters],
    )


def print_retries(outcomes: list[Retried]) -> None:
    print_table(
        ("LETTER", "JOB", "OUTCOME", "NEW ENTRY", "REASON"),
        [(r.letter_id, r.job_id, r.outcome, r.entry_id or "-", r.reason) for r in outcomes],
    )


def print_workers(workers: list[WorkerHealth]) -> None:
    rows = []
    for w in workers:
        i = w.info
        if i is None:  # a heartbeat that does not parse: a worker of another version?
            rows.append(
                (w.name, w.queue, "-", "-", f"{w.condition} heartbeat", "-", "-", "-", f"{w.heartbeat_age_s:.1f}s ago")
            )
            continue
        state = i.state + (" (stale)" if w.condition == "stale" else "")
        kv = f"{i.total_pages - i.free_pages}/{i.total_pages} pages" if i.total_pages else f"{i.free_pages} free pages"
        rows.append(
            (w.name, w.queue, i.model, i.device, state, i.running, i.free_slots, kv, f"{w.heartbeat_age_s:.1f}s ago")
        )
    print_table(("NAME", "QUEUE", "MODEL", "DEVICE", "STATE", "RUNNING", "FREE SLOTS", "KV USED", "HEARTBEAT"), rows)


def print_waiting(jobs: list[WaitingJob]) -> None:
    print_table(
        ("JOB", "ENTRY", "WAITING", "LANE", "TENANT", "PLACED ON"),
        [(j.job_id, j.entry_id, f"{j.waited_s:.1f}s", j.lane, j.tenant or "-", j.worker or "-") for j in jobs],
    )


def print_running(jobs: list[RunningJob]) -> None:
    print_table(
        ("JOB", "ENTRY", "WORKER", "DELIVERIES", "IDLE", "TOKENS", "LANE", "TENANT"),
        [
            (j.job_id, j.entry_id, j.worker, j.deliveries, f"{j.idle_s:.1f}s", j.tokens, j.lane, j.tenant or "-")
            for j in jobs
        ],
    )


def print_table(headers: Sequence[str], rows: list[Sequence[object]]) -> None:
    cells = [list(headers)] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    if not rows:
        print("(none)", file=sys.stderr)


def utc(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
