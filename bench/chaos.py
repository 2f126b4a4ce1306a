"""Random fault schedules against the queue protocol, more of them than CI runs: each draws
submits (placed on workers' own streams when two workers or more serve), cancels, deadlines,
stalled, killed and drained workers, Redis restarts, SCRIPT FLUSH
and out-of-memory windows from its seed, runs them against one real redis-server, and checks
every invariant (harness/chaos_schedules.py says which). A failure prints the schedule, its seed
and what broke; the run goes on and ends with the count of clean schedules.

    python -m bench.chaos [--schedules 1000] [--seed FIRST]      seeds FIRST, FIRST+1, ...
    python -m bench.chaos --seed 58 --schedules 1                 one schedule again
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from harness.chaos_schedules import SHARDS, STARVED_S, ScheduleFailed, run_schedule
from harness.redis_servers import RestartableRedis


def main() -> int:
    args = parse_args()
    first = random.randrange(10**6) if args.seed is None else args.seed
    logging.basicConfig(
        level=logging.WARNING,
        filename=args.log,
        filemode="w",
        format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s",
    )
    server = RestartableRedis(Path(tempfile.mkdtemp(prefix="mili-chaos-"))).start()
    failed: list[int] = []
    jobs = starved = 0
    moved = {"placed": 0, "stolen": 0, "reclaimed": 0, "laned": 0, "sharded": 0}
    started = time.monotonic()
    try:
        bar = tqdm(range(first, first + args.schedules), unit="schedule", desc=f"seeds from {first}")
        for seed in bar:
            logging.warning("=== schedule seed=%d", seed)
            try:
                counts = run_schedule(seed, server)
                jobs += counts["jobs"]
                starved += counts["starved"] > 0
                for name in moved:
                    moved[name] += counts[name]
            except ScheduleFailed as e:
                failed.append(seed)
                tqdm.write(f"FAILED {e}")
            bar.set_postfix(clean=bar.n + 1 - len(failed), failed=len(failed))
    finally:
        server.stop()
    clean = args.schedules - len(failed)
    print(
        f"{clean} of {args.schedules} schedules clean (seeds {first}..{first + args.schedules - 1}), "
        f"{jobs} jobs ({moved['placed']} placed on workers' own streams, {moved['stolen']} stolen, "
        f"{moved['reclaimed']} reclaimed, {moved['laned']} of a tenant or another lane than default; {moved['sharded']} schedules over {SHARDS} shards), {time.monotonic() - started:.0f} s; failed seeds: {failed or 'none'}; {starved} schedules "
        f"had a worker thread the machine left unscheduled for {STARVED_S * 1000:.0f} ms; worker log: {args.log}"
    )
    return 1 if failed else 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", type=int, default=1000, help="how many schedules to run")
    parser.add_argument("--seed", type=int, help="the first schedule's seed (default: random)")
    parser.add_argument("--log", default="chaos.log", help="the workers' warnings, by schedule")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
