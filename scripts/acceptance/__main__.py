"""python -m scripts.acceptance [--rehearse] STAGE OUTDIR [--only STEP,...] (see scripts/gpu_acceptance.sh)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from scripts.acceptance.runner import Run, run_stage
from scripts.acceptance.stages import stages


def parse_args(known: dict) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu_acceptance.sh", description=__doc__)
    p.add_argument(
        "--rehearse", action="store_true", help="on the CPU at tiny shapes; GPU-only steps are SKIP (no CUDA)"
    )
    p.add_argument("--only", help="comma-separated steps of the stage to run (after a fix, or when time ran out)")
    p.add_argument("stage", choices=list(known))
    p.add_argument("outdir", type=Path, help="where the stage's log, table (.md) and figures (.json) go")
    return p.parse_args()


def stop_on_sigterm() -> None:
    """A deadline's SIGTERM (scripts/gpu_session.sh) unwinds the runner, which ends its step's processes."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def main() -> int:
    stop_on_sigterm()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    known = stages()
    args = parse_args(known)
    stage = known[args.stage]
    only = set(args.only.split(",")) if args.only else None
    unknown = (only or set()) - {step.name for step in stage.steps}
    if unknown:
        print(
            f"{args.stage} has no step {', '.join(sorted(unknown))}; its steps: "
            f"{', '.join(step.name for step in stage.steps)}",
            file=sys.stderr,
        )
        return 2
    run = Run.prepare(args.rehearse, args.outdir)
    if not args.rehearse and not run.cuda:
        print(
            f"no CUDA device visible to torch {run.machine['torch']}: nothing of stage {args.stage} can run "
            f"(--rehearse runs it on the CPU)",
            file=sys.stderr,
        )
        return 1
    return 0 if run_stage(stage, run, only) else 1


if __name__ == "__main__":
    sys.exit(main())
