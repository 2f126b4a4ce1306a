#!/usr/bin/env bash
# Sets up the machine (see bootstrap.sh) and runs the tests; arguments after the flag go to pytest.
#   scripts/test.sh            the static checks (ruff, mypy) and every test: what CI runs (.ci/run)
#   scripts/test.sh --quick    the static checks and the fast tier, for local work: no test marked slow, e2e or chaos
#                              (tests/support/tiers.py says how a test gets each mark)
# The tests run on two pytest-xdist processes, and those marked `waits` (they mostly wait on
# timeouts and faults) in a third pytest process beside them (two with --quick, below); then the
# `timing` tests (bounds on elapsed time) run after them, so that no other test stretches their
# time (their process collects beside the others, and waits for them before its first test): alone
# in the full run, two at a time with --quick (below).
set -euo pipefail
cd "$(dirname "$0")/.."
parallel="not timing"
serial="timing"
# The waiting tests' processes: one in the full run, where they end minutes before the others (10 min
# of 14.5), so a second would only add its collection's CPU to theirs. In the quick run they were
# the last to end (3:02 beside the others' 2:20, each test mostly asleep): two processes end them
# before the others, for a collection's CPU (~7 s).
waits_processes=()
# The timing tests' processes, each its share of them (tests/support/shard.py): one in the full run
# (CI), where nothing at all runs beside a timing test. In the quick run their lane ran last and
# alone for ~34 s, one core idle and the other at 0.12 of a core (3.5 s of CPU over ~29 s of tests,
# each mostly asleep; the busiest, a grammar checked while other coroutines run, half a core): two
# processes, a core each, end it in about half that, for one more collection beside the others
# (pytest-xdist's controller and two workers cost a third process and more CPU there: y/suite6).
timing_processes=1
# The folders of tests/ whose every test is of a tier --quick leaves out, by their folder alone
# (tests/support/tiers.py's CHAOS_DIRS and E2E_DIRS): its lanes do not collect them, where each of
# its seven collecting processes imported their modules and built their ~270 tests to deselect them.
left_out=()
if [ "${1:-}" = "--quick" ]; then
  left_out=(chaos e2e board)
  parallel="not (timing or slow or e2e or chaos)"
  serial="timing and not (slow or e2e or chaos)"
  waits_processes=(-n 2 --dist loadgroup)
  timing_processes=2
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
# The waiting tests' report comes after the others' (two reports written at once would interleave).
# They compute little beside two processes that take a core each: one torch thread for them and
# the processes they start.
waits_log=$(mktemp)
MILI_TESTS_GATE="$warmed" MILI_TESTS_GATE_FOR="the kernels' warm-up" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
  .venv/bin/python -m pytest "${waits_modules[@]}" "${waits_processes[@]}" -m "($parallel) and waits" \
  -p tests.support.gate "$@" > "$waits_log" 2>&1 &
waits_pid=$!
# The timing tests' processes collect now, beside the others (the whole tree was ~6 s of CPU, the
# lane's own wall time after theirs), and run their first test once $gate exists, made when they
# are done: no other test runs beside the timing tests.
# With two, each has one torch thread, as each of the two xdist processes has (tests/conftest.py),
# and they share the tests out as they go through an empty folder (tests/support/shard.py).
timing_env=()
timing_share=""
if [ "$timing_processes" -gt 1 ]; then
  timing_share=$(mktemp -d)
  timing_env=(OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MILI_TESTS_SHARE="$timing_share")
fi
timing_logs=()
timing_pids=()
for ((process = 0; process < timing_processes; process++)); do
  timing_logs+=("$(mktemp)")
  MILI_TESTS_GATE="$gate" MILI_TESTS_GATE_FOR="the other lanes" env "${timing_env[@]}" .venv/bin/python -m pytest \
    "${timing_modules[@]}" -m "$serial" -p tests.support.gate -p tests.support.shard "$@" > "${timing_logs[$process]}" 2>&1 &
  timing_pids+=($!)
done
MILI_TESTS_GATE="$warmed" MILI_TESTS_GATE_FOR="the kernels' warm-up" .venv/bin/python -m pytest tests \
  "${left_out[@]/#/--ignore=tests/}" -n 2 --dist loadgroup -m "($parallel) and not waits" -p tests.support.gate --durations=30 "$@" &
others_pid=$!
trap 'kill "$warm_up_pid" "$waits_pid" "${timing_pids[@]}" "$others_pid" 2>/dev/null || true
  rm -rf "$warm_up_log" "$waits_log" "${timing_logs[@]}" "$warmed" "$gate" ${timing_share:+"$timing_share"}' EXIT
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
# The first process's report as it runs, then the other's once it ends (two written at once would
# interleave).
tail -n +1 -f --pid="${timing_pids[0]}" "${timing_logs[0]}"
timing=()
for ((process = 0; process < timing_processes; process++)); do
  status=0
  wait "${timing_pids[$process]}" || status=$?
  timing+=("$status")
  if [ "$process" -gt 0 ]; then
    echo "--- the tests marked timing that the second process ran:"
    cat "${timing_logs[$process]}"
  fi
done
# 5 is pytest's "no test selected": a pass that arguments such as -k left empty, not a failure
# unless every run is.
all_empty=1
for status in "$others" "$waits" "${timing[@]}"; do
  if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then exit "$status"; fi
  [ "$status" -eq 5 ] || all_empty=0
done
exit $((all_empty ? 5 : 0))
