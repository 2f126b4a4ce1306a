#!/usr/bin/env bash
# The GPU acceptance stages, each ending in one PASS/FAIL table, with its log, table and figures
# written under OUTDIR (STAGE.log, STAGE.md, STAGE.json; the bench stage adds a profiler trace).
# --rehearse runs a stage on the CPU at tiny shapes, through the same scripts and tests; what only a
# GPU can run is reported SKIP (no CUDA). The stages are scripts/acceptance/stages/*.py.
#
# Usage: scripts/gpu_acceptance.sh [--rehearse] STAGE OUTDIR [--only STEP,...]
#   STAGE: one of scripts/acceptance/stages ORDER (docs/gpu-acceptance.md has the plan and the table)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "gpu_acceptance.sh: no .venv; run scripts/bootstrap.sh (--offline DIR on a GPU host) first" >&2; exit 1; }
# The tests start redis-server by name: bootstrap --offline puts the bundle's in the venv's bin.
# compute-sanitizer lives with the CUDA toolkit, which a shell's PATH may not name.
export PATH="$PWD/.venv/bin:$PATH${CUDA_HOME:+:$CUDA_HOME/bin}:/usr/local/cuda/bin"
exec .venv/bin/python -m scripts.acceptance "$@"
