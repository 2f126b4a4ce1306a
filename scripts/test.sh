#!/usr/bin/env bash
# Sets up the machine (see bootstrap.sh) and runs the tests; arguments after the flag go to pytest.
#   scripts/test.sh            the static checks (ruff, mypy) and every test: what CI runs (.ci/run)
#   scripts/test.sh --quick    the static checks and the fast tier, for local work: no test marked slow, e2e or chaos
#                              (tests/support/tiers.py says how a test gets each mark)
# The tests run on two pytest-xdist processes, and those marked `waits` (they mostly wait on
# timeouts and faults) in a third pytest process beside them (three with --quick, below); then the
# `timing` tests (bounds on elapsed time) run after them, so that no other test stretches their
# time (their process collects beside the others, and waits for them before its first test): alone
# in the full run, four at a time with --quick (below).
set -euo pipefail
cd "$(dirname "$0")/.."
parallel="not timing"
serial="timing"
# A lane's processes, each its share of its tests (tests/support/shard.py): one collects, and forks
# the others at its first test, so that more cost no collection (~4-5 s of CPU each, spent beside
# the xdist lane that keeps both cores busy), where pytest-xdist's controller and workers each
# import torch and collect.
# The waiting tests' processes: one in the full run, where they end minutes before the others (10 min
# of 14.5). In the quick run they ended last (3:02 beside the others' 2:20, each test mostly
# asleep): three end them before the others.
waits_processes=1
# The timing tests' processes: one in the full run (CI), where nothing at all runs beside a timing
# test. In the quick run their lane runs last and alone, each test mostly asleep (~5 s of CPU over
# ~37 s of tests; the longest ~3.5 s): four end it in about a quarter of that.
timing_processes=1
# The folders of tests/ whose every test is of a tier --quick leaves out, by their folder alone
# (tests/support/tiers.py's CHAOS_DIRS and E2E_DIRS): its lanes do not collect them, where each of
# its seven collecting processes imported their modules and built their ~270 tests to deselect them.
left_out=()
if [ "${1:-}" = "--quick" ]; then
  left_out=(chaos e2e board)
  parallel="not (timing or slow or e2e or chaos)"
  serial="timing and not (slow or e2e or chaos)"
  waits_processes=3
  timing_processes=4
  shift
fi
scripts/bootstrap.sh --dev
# The suite starts hundreds of Python processes (pytest steps, workers, gateways, CLIs); where the
# environment forbids bytecode caches (PYTHONDONTWRITEBYTECODE, as this project's sandbox sets),
# each compiles the project's modules again: ~1 s of CPU per pytest process, 10% of the tp stage's
# rehearsal (94 s -> 85 s). The caches go to the ignored __pycache__ folders.
unset PYTHONDONTWRITEBYTECODE
# The engine's CPU kernels (numba) compile on first use and are cached under kernels/__pycache__:
# compiled once here, not by each of the first processes that need them at once on a fresh clone
# (one tiny engine's start: 24 s with no cache, 6 s with it); beside the static checks, a core each
# (on a fresh clone ~12 s of CPU for this, ~6 s for mypy).
warm_up_log=$(mktemp)
.venv/bin/python -c "from worker.engine.engine import Engine; Engine.from_pretrained('tiny').warm_up()" \
  > "$warm_up_log" 2>&1 &
warm_up_pid=$!
trap 'kill "$warm_up_pid" 2>/dev/null || true; rm -f "$warm_up_log"' EXIT
# The static checks first: lint, format and types ([tool.ruff] and [tool.mypy] in
# pyproject.toml say what each covers).
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy

# The waits and timing lanes collect only the modules that name their mark (tests/support/tiers.py
# refuses a test marked where its module does not): the whole tree cost each of their processes
# ~5 s more CPU (13.2 s against 7.7 s for the waits tests' 24 modules), spent beside the others.
not_left_out() {
  local module folder
  while read -r module; do
    for folder in "${left_out[@]}"; do [[ $module == tests/$folder/* ]] && continue 2; done
    echo "$module"
  done
}
modules_naming() { grep -rl --include='test_*.py' -e "pytest.mark.$1" tests | sort | not_left_out; }
mapfile -t waits_modules < <(modules_naming waits)
mapfile -t timing_modules < <(modules_naming timing)
# The lanes start now and collect beside the warm-up's end (on a set-up clone the warm-up is ~6 s
# of one core's CPU, the static checks under 1 s: the other core idled), and run their first test
# once $warmed exists, made when the warm-up is done (tests/support/gate.py), so that no test
# compiles the kernels beside it on a fresh clone.
warmed=$(mktemp -u)
gate=$(mktemp -u)
# shared_by N ENV sets the array ENV to the environment of a lane of N processes: with more than
# one, the folder they share the tests out through (tests/support/shard.py) and their count.
share_folders=()
shared_by() {
  local -n lane_env=$2
  lane_env=()
  [ "$1" -gt 1 ] || return 0
  share_folders+=("$(mktemp -d)")
  lane_env=(MILI_TESTS_SHARE="${share_folders[-1]}" MILI_TESTS_SHARES="$1")
}
# The waiting tests' report comes after the others' (two reports written at once would interleave).
# They compute little beside two processes that take a core each: one torch thread for them and
# the processes they start.
waits_log=$(mktemp)
shared_by "$waits_processes" waits_env
MILI_TESTS_GATE="$warmed" MILI_TESTS_GATE_FOR="the kernels' warm-up" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
  env "${waits_env[@]}" .venv/bin/python -m pytest "${waits_modules[@]}" -m "($parallel) and waits" \
  -p tests.support.gate -p tests.support.shard "$@" > "$waits_log" 2>&1 &
waits_pid=$!
# The timing tests' process collects now, beside the others (the whole tree was ~6 s of CPU, the
# lane's own wall time after theirs), and runs its first test once $gate exists, made when they
# are done: no other test runs beside the timing tests. Shared out, each process has one torch
# thread, as each of the two xdist processes has (tests/conftest.py).
timing_log=$(mktemp)
shared_by "$timing_processes" timing_env
[ "$timing_processes" -eq 1 ] || timing_env+=(OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}")
MILI_TESTS_GATE="$gate" MILI_TESTS_GATE_FOR="the other lanes" env "${timing_env[@]}" .venv/bin/python -m pytest \
  "${timing_modules[@]}" -m "$serial" -p tests.support.gate -p tests.support.shard "$@" > "$timing_log" 2>&1 &
timing_pid=$!
MILI_TESTS_GATE="$warmed" MILI_TESTS_GATE_FOR="the kernels' warm-up" .venv/bin/python -m pytest tests \
  "${left_out[@]/#/--ignore=tests/}" -n 2 --dist loadgroup -m "($parallel) and not waits" -p tests.support.gate --durations=30 "$@" &
others_pid=$!
trap 'kill "$warm_up_pid" "$waits_pid" "$timing_pid" "$others_pid" 2>/dev/null || true
  rm -rf "$warm_up_log" "$waits_log" "$timing_log" "$warmed" "$gate" "${share_folders[@]}"' EXIT
warm_up=0
wait "$warm_up_pid" || warm_up=$?
cat "$warm_up_log"
[ "$warm_up" -eq 0 ] || exit "$warm_up"
touch "$warmed"
others=0
wait "$others_pid" || others=$?
waits=0
wait "$waits_pid" || waits=$?
echo "--- the tests marked waits, run beside the others:"
cat "$waits_log"
touch "$gate"
# Its report as it runs (the forked processes' at its end).
tail -n +1 -f --pid="$timing_pid" "$timing_log"
timing=0
wait "$timing_pid" || timing=$?
# 5 is pytest's "no test selected": a pass that arguments such as -k left empty, not a failure
# unless every run is.
all_empty=1
for status in "$others" "$waits" "$timing"; do
  if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then exit "$status"; fi
  [ "$status" -eq 5 ] || all_empty=0
done
exit $((all_empty ? 5 : 0))
