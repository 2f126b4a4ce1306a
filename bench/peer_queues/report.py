"""bench/peers.py's output: the table with MILI's ratios to the best peer, the target rows of
issue 43, and where Redis's time per job goes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    digits: int
    higher_is_better: bool = False

    def show(self, value: float | None) -> str:
        return "-" if value is None else f"{value:,.{self.digits}f}"


COLUMNS = (
    Column("jobs_per_s", "jobs/s", 0, higher_is_better=True),
    Column("added_p50_ms", "added p50 ms", 2),
    Column("added_p99_ms", "added p99 ms", 2),
    Column("producer_cpu_low_load_us", "CPU/job producer, 1 producer us", 0),
    Column("producer_cpu_us", "CPU/job producers us", 0),
    Column("worker_cpu_us", "CPU/job workers us", 0),
    Column("redis_cpu_us", "CPU/job Redis us", 0),
    Column("memory_per_job", "Redis B/job kept", 0),
    Column("submit_wall_us", "submit wall us", 0),
    Column("submit_cpu_us", "submit CPU us, Redis on its core", 0),
    Column("apart_submit_cpu_us", "submit CPU us, Redis on another core", 0),
    Column("submit_instructions", "submit instructions", 0),
    Column("submit_calls", "calls/submit", 0),
    Column("submit_python_calls", "Python calls/submit", 0),
)
PEER_NAMES = ("dramatiq", "taskiq", "arq", "celery")


def best_peers(table: dict[str, dict]) -> dict[str, str]:
    """Column key -> the peer with the best median in it."""
    peers = [name for name in PEER_NAMES if name in table]
    pick = {True: max, False: min}
    return {
        c.key: pick[c.higher_is_better](peers, key=lambda n: table[n][c.key])
        for c in COLUMNS
        if peers and all(c.key in table[n] for n in peers)  # a one-CPU machine runs no submit apart
    }


def print_table(table: dict[str, dict], rounds: int) -> None:
    print(f"\nMedians over {rounds} rounds (mili-16: MILI with 16-token jobs, one load run alone):\n")
    print("| library | " + " | ".join(c.header for c in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for name, figures in table.items():
        print(f"| {name} | " + " | ".join(c.show(figures.get(c.key)) for c in COLUMNS) + " |")
    best = best_peers(table)
    if not best or "mili" not in table:
        return
    print(
        "| best peer | "
        + " | ".join(f"{best[c.key]} {c.show(table[best[c.key]][c.key])}" if c.key in best else "-" for c in COLUMNS)
        + " |"
    )
    ratios = (f"**{table['mili'][c.key] / table[best[c.key]][c.key]:.2f}x**" if c.key in best else "-" for c in COLUMNS)
    print("| **MILI / best peer** | " + " | ".join(ratios) + " |")


def print_targets(table: dict[str, dict]) -> None:
    if "mili" not in table:
        return
    mili, best = table["mili"], best_peers(table)
    rows = []
    if best:
        fastest, quickest = best["jobs_per_s"], best["added_p50_ms"]
        ratio = mili["jobs_per_s"] / table[fastest]["jobs_per_s"]
        rows.append(("End-to-end jobs/s >= 1.2x the best peer", f"{ratio:.2f}x {fastest}'s", ratio >= 1.2))
        p50, peer_p50 = mili["added_p50_ms"], table[quickest]["added_p50_ms"]
        rows.append(
            ("p50 added latency <= the best peer's", f"{p50:.2f} vs {quickest}'s {peer_p50:.2f} ms", p50 <= peer_p50)
        )
    rows.append(("Redis CPU per 1-token job <= 40 us", f"{mili['redis_cpu_us']:.0f} us", mili["redis_cpu_us"] <= 40))
    if "mili-16" in table:
        kept = table["mili-16"]["memory_per_job"]
        rows.append(("memory per finished job kept <= 1,024 B (16 tokens)", f"{kept:,.0f} B", kept <= 1024))
    rows.append(submit_row(mili))
    print("\n| target (issue 43) | MILI in this run | |\n|---|---|---|")
    for target, figure, met in rows:
        print(f"| {target} | {figure} | {'met' if met else 'missed'} |")


def submit_row(mili: dict) -> tuple[str, str, bool]:
    """Met where a submit is in budget with redis-server on the producer's core and, where the
    machine has another, on that one (where the producer sleeps for each reply): a user gets either."""
    placements = {"on its core": mili["submit_cpu_us"]}
    if "apart_submit_cpu_us" in mili:
        placements["on another"] = mili["apart_submit_cpu_us"]
    figure = ", ".join(f"{cpu:.0f} us with Redis {where}" for where, cpu in placements.items())
    return "one submit <= 100 us CPU in the producer", figure, all(cpu <= 100 for cpu in placements.values())


def print_commands(commands: dict[str, dict[str, tuple[float, float]]], top: int = 8) -> None:
    """Each library's Redis commands per job in its last load run (commandstats: a command that a
    script runs counts under its own name too, and its time is in the script's as well)."""
    print("\nRedis commands per job, last load run of each (INFO commandstats: calls/job, us/job; commands run")
    print("inside a script count under their own names too, and their time is also in the script's):")
    for name, per_job in commands.items():
        ranked = sorted(per_job.items(), key=lambda item: -item[1][1])[:top]
        print(f"  {name}: " + ", ".join(f"{cmd} {calls:.2f} ({usec:.1f} us)" for cmd, (calls, usec) in ranked))


def print_breakdown(costs: dict, redis_cpu_us: float | None) -> None:
    per_job = costs["per_job"]
    total = sum(usec for _, usec in per_job.values())
    complete = "" if costs["complete"] else " (the slowlog filled up: older entries lost)"
    print("\nMILI's Redis time per job by command and script: SLOWLOG of every command (execution time only)")
    print(f"over a load run of its own, {costs['jobs']:,} jobs, {costs['entries']:,} entries{complete}:\n")
    print("| command sent | calls/job | us/call | us/job | share |\n|---|---|---|---|---|")
    for name, (calls, usec) in sorted(per_job.items(), key=lambda item: -item[1][1]):
        print(f"| {name} | {calls:.3f} | {usec / calls:.1f} | {usec:.1f} | {usec / total:.0%} |")
    print(f"| all | | | {total:.1f} | |")
    if redis_cpu_us is not None:
        print(f"\n(The table's Redis CPU per job, {redis_cpu_us:.0f} us, also holds reading, parsing and answering.)")
    print("\nInside each script, per call (calls, us; the rest of a script's time is Lua's own):")
    for script, commands in sorted(costs["inside"].items(), key=lambda item: -per_job[item[0]][1]):
        calls, usec = per_job[script]
        ranked = sorted(commands.items(), key=lambda item: -item[1][1])
        inner = ", ".join(f"{cmd} {n:.2f} ({us:.1f})" for cmd, (n, us) in ranked)
        print(f"  {script} ({usec / calls:.1f} us): {inner}")
