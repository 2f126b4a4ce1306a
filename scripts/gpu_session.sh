#!/usr/bin/env bash
# One device command for a whole lease: the offline bootstrap, then stages (or some of their steps)
# back to back until a deadline, and everything they wrote packed into one archive, since a device
# run brings back at most 8 files. What the deadline cut says NOT RUN, or "stopped", in its table.
#
# Usage: scripts/gpu_session.sh [--rehearse] SECONDS OUTDIR SPEC...
#   SPEC: STAGE, or STAGE:STEP,STEP (gpu_acceptance.sh's --only); each runs in OUTDIR/NN-STAGE/
#   OUTDIR gets acceptance.tgz (every stage's .md, .json, .log and trace) and tables.md
#   --rehearse: the stages' CPU rehearsals over this machine's .venv, no bootstrap (CI runs this)
# Example (the bundle from scripts/bundle.sh, carried as .bundle):
#   scripts/gpu_session.sh 540 $OUT kernels:smoke,tests engine:graph-smoke bench:kernels,decode-step
set -uo pipefail
cd "$(dirname "$0")/.."
rehearse=(); [ "${1:-}" = "--rehearse" ] && { rehearse=(--rehearse); shift; }
[ $# -ge 3 ] || { sed -n '6,11p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
deadline=$(( $(date +%s) + $1 )); out=$2; shift 2
mkdir -p "$out"
work=$(mktemp -d)

pack() {
  cat "$work"/*/*.md > "$out/tables.md" 2>/dev/null
  tar czf "$out/acceptance.tgz" -C "$work" .
  cat "$out/tables.md"
}

# The runner ends its step's processes when the deadline stops it (SIGTERM); on the GPU host, where
# nothing else runs, whatever a step left behind goes too, so that the next stage has the GPU alone.
sweep() {
  [ ${#rehearse[@]} -eq 0 ] || return 0
  pkill -9 -f "$PWD/.venv/bin/python" 2>/dev/null
  pkill -9 -x redis-server 2>/dev/null
  sleep 1
}

{ nvidia-smi; ldd --version | head -1; } > "$work/host.txt" 2>&1
if [ ${#rehearse[@]} -eq 0 ]; then
  if ! scripts/bootstrap.sh --offline .bundle > "$work/bootstrap.log" 2>&1; then
    tail -30 "$work/bootstrap.log"; pack; exit 1
  fi
  tail -4 "$work/bootstrap.log"
fi
# No network there: a hub lookup would wait for its timeout.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
n=0
for spec in "$@"; do
  n=$((n + 1))
  stage=${spec%%:*}; only=(); [ "$stage" = "$spec" ] || only=(--only "${spec#*:}")
  left=$(( deadline - $(date +%s) ))
  if [ "$left" -lt 30 ]; then echo "[session] $spec: not run, $left s left"; continue; fi
  echo "[session] $spec: up to $left s"
  timeout -k 5 "$left" scripts/gpu_acceptance.sh "${rehearse[@]}" "$stage" "$work/$(printf %02d $n)-$stage" "${only[@]}" \
    > "$work/$(printf %02d $n)-$stage.out" 2>&1
  echo "[session] $spec: exit $?"
  sweep
done
pack
