#!/usr/bin/env bash
# Runs every CI test tier in order and prints each tier's wall time.
#   unit        native CPython with numpy: wire, codecs, fuzz, model, protocol rules, conformance
#   sim         seeded discrete-event simulations of many ranks (invariants from the bus log)
#   runtime     the asyncio driver under virtual time (looptime)
#   pg          the fixed-world process group: collectives across 2-4 real processes (TCP)
#   no-numpy    unit + conformance natively with numpy made unimportable
#   pyodide     unit + conformance + sim (a sweep's first seeds) in Pyodide 314 (Python 3.14), Node 20
#   browser     real Chromium + real Pyodide tabs joining a real server (Playwright)
#   mutations   breaks each PROTOCOL.md rule on purpose; its named test must fail
#   container   builds the Docker image and runs the compose demo for real (root; installs docker.io)
# Usage: bash scripts/test.sh [tier ...]   (default: all tiers)
# With no tier named, the CPU-bound tiers that time nothing (mutations pyodide | unit runtime sim
# no-numpy, and pg, whose few time bounds leave seconds of slack) run in two lanes at once,
# one per core, and the container tier (mostly installs and an image build) in a third beside
# them, each lane's output printed when it ends; the
# network tiers (integration browser), whose tests wait on real sockets and timers,
# then run one tier at a time, integration and browser with two pytest-xdist workers (their
# tests wait on sockets and timers about half the time: measured 1018 -> 580 s and 630 -> 430 s
# on this 2-core machine). TABCOHORT_TEST_LANES=1 runs everything in order;
# TABCOHORT_TEST_WORKERS=N sets the workers (1: none, every test in the one pytest process).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/client_py:$PWD/server${PYTHONPATH:+:$PYTHONPATH}"
# Bytecode is written and read as on any machine: a CI image that sets PYTHONDONTWRITEBYTECODE
# made every `tabcohort serve`/`rank` process the integration tests start compile the package
# from source (about 0.3 s of CPU each, of hundreds of processes) and every forked mutation run
# rewrite its test file's asserts again (a one-test run took 6 s instead of 2.6 s). Compiled once
# here, before the lanes start, so that no two tiers compile the same module at once.
unset PYTHONDONTWRITEBYTECODE
"$PY" -m compileall -q client_py server tests >/dev/null || true
common=(-q -p no:cacheprovider --timeout=600 --durations=12)
workers="${TABCOHORT_TEST_WORKERS:-2}"
case $workers in ''|*[!0-9]*|0) echo "TABCOHORT_TEST_WORKERS=$workers: expected a whole number >= 1 (default 2)" >&2; exit 2 ;; esac
parallel=()   # (worksteal: a worker that runs out of tests takes half of the other's queue)
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist worksteal)
tiers=("$@")
lanes=0
if [ ${#tiers[@]} -eq 0 ]; then
  tiers=(unit sim runtime no-numpy pyodide mutations integration pg browser container)
  [ "${TABCOHORT_TEST_LANES:-2}" = 1 ] || lanes=1
fi
results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT
# Ctrl-C (or TERM): each lane runs in a process group of its own, which a terminal's Ctrl-C does
# not reach, so it is passed on; pytest catches SIGINT and exits normally, so the flag file is what
# stops every lane and the tiers after them. The summary still prints.
lane_groups=""
on_stop() {
  touch "$results/stop"
  echo; echo "=== interrupted: no further tier starts"
  for g in $lane_groups; do kill -INT -- "-$g" 2>/dev/null; done
}
trap on_stop INT TERM
stopped() { [ -e "$results/stop" ]; }

# Network tests run in a private network namespace holding only `lo` when we can make one (root):
# deterministic, and nothing they send can leave the machine. Otherwise on the host's loopback.
netns() {
  if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null && unshare -n true 2>/dev/null; then
    echo "(in a private network namespace: lo only)"
    unshare -n sh -c 'ip link set lo up && exec "$@"' sh "$@"
  else
    "$@"
  fi
}

# two_pass DIR MARKS: the tests of DIR selected by MARKS on the workers, except those marked
# serial (they assert a rate or a time gap, which a test on the other worker would move), which
# then run alone. Exit status: the first pass's failure, else the second's (5, none selected, is 0).
two_pass() {
  local dir=$1 marks=$2 a=0 b=0
  if [ ${#parallel[@]} -eq 0 ]; then
    "$PY" -m pytest "$dir" -m "$marks" "${common[@]}"; return $?
  fi
  "$PY" -m pytest "$dir" -m "($marks) and not serial" "${common[@]}" "${parallel[@]}" || a=$?
  echo "--- the tests marked serial, alone"
  "$PY" -m pytest "$dir" -m "($marks) and serial" "${common[@]}" || b=$?
  [ $a -eq 5 ] && a=0
  [ $b -eq 5 ] && b=0
  [ $a -ne 0 ] && return $a
  return $b
}

run_tier() {
  local name=$1; shift
  echo "=== tier $name: $*"
  local t0=$(date +%s)
  "$@"
  local rc=$?
  [ $rc -eq 5 ] && rc=0   # pytest: no tests collected in this tier
  local took=$(( $(date +%s) - t0 ))
  echo "$rc $took" > "$results/$name"
  echo "=== tier $name: exit $rc in $took s"
}

tier() {
  local t=$1
  case $t in
    unit) run_tier unit "$PY" -m pytest tests/unit tests/conformance -m "not slow and not integration" "${common[@]}" ;;
    sim) run_tier sim "$PY" -m pytest tests/sim -m "not slow" "${common[@]}" ;;
    runtime) run_tier runtime "$PY" -m pytest tests/runtime -m "not slow" "${common[@]}" ;;
    integration)
      if [ -d tests/integration ]; then
        run_tier integration netns bash -c "$(declare -f two_pass); $(declare -p PY common parallel); two_pass tests/integration 'not slow'"
      fi ;;
    pg) run_tier pg netns "$PY" -m pytest tests/pg -m "not slow" "${common[@]}" ;;
    # (no-numpy leaves the simulations to the Pyodide tier, which runs them without numpy too, in
    # the tab's own interpreter; and the Pyodide tier runs the first seeds of a seeded sweep, the
    # sim tier all of them: tests marked sweep)
    no-numpy) run_tier no-numpy bash tests/no_numpy/run.sh tests/unit tests/conformance \
                -m "not slow and not integration" "${common[@]}" ;;
    pyodide) run_tier pyodide bash tests/pyodide/run.sh tests/unit tests/conformance tests/sim \
                -m "not slow and not integration and not sweep" -q -p no:cacheprovider ;;
    browser) TABCOHORT_BROWSER_REQUIRED=1 run_tier browser two_pass tests/browser "browser and not slow" ;;
    mutations) run_tier mutations "$PY" tests/mutations/run.py ;;
    container) run_tier container bash tests/container/run.sh ;;
    *) echo "unknown tier $t"; exit 2 ;;
  esac
}

lane() {   # run the named tiers in order, output to a file printed whole when the lane ends
  local log="$results/lane-$1.log"; shift
  for t in "$@"; do stopped && break; tier "$t"; done > "$log" 2>&1
}

t_all=$(date +%s)
if [ $lanes = 1 ]; then
  t0=$(date +%s)
  # (balanced by the tiers' measured times: mutations + pyodide about as long as the other four,
  # since the mutations' children are forked from one process with the test tools loaded)
  # The container tier runs beside them, in a third lane: most of its time is installing the
  # engine, debootstrap and the image build (downloads and disk, 125 of its 77-208 s), and its
  # checks have bounds of minutes, so the CPU lanes slow it without failing it
  # The pg tier (a minute of real processes on TCP; its few time bounds leave seconds of slack, and
  # it passed beside a busy core) ends the lane that is about that much shorter: lane b since the
  # sim tier's checks stopped being quadratic (a CI run measured mutations 452 + pyodide 286 s
  # against unit 259 + runtime 5 + sim 226 + no-numpy 211 s, the sim tier 112 s after the change),
  # and lane a since a later one measured mutations 375 + pyodide 241 s against unit 293 + runtime
  # 5 + sim 121 + no-numpy 241 s
  echo "=== lanes: (mutations pyodide pg) | (unit runtime sim no-numpy), one per core; (container) beside them"
  set -m   # (job control: each lane a process group of its own, SIGINT not ignored in it)
  lane a mutations pyodide pg & pa=$!
  lane b unit runtime sim no-numpy & pb=$!
  lane c container & pc=$!
  set +m
  lane_groups="$pa $pb $pc"
  # (a trapped signal ends a wait early: wait again while the lane lives)
  while kill -0 $pa 2>/dev/null; do wait $pa; done; cat "$results/lane-a.log"
  while kill -0 $pb 2>/dev/null; do wait $pb; done; cat "$results/lane-b.log"
  while kill -0 $pc 2>/dev/null; do wait $pc; done; cat "$results/lane-c.log"
  echo "=== lanes: done in $(( $(date +%s) - t0 )) s"
  for t in integration browser; do stopped && break; tier "$t"; done
else
  for t in "${tiers[@]}"; do stopped && break; tier "$t"; done
fi

echo
echo "tier times:"
fail=0
for t in "${tiers[@]}"; do
  if [ ! -f "$results/$t" ]; then   # (a tier that left no result did not run: a failure)
    printf '  %-12s    - s  NOT RUN\n' "$t"; fail=1; continue
  fi
  read -r rc took < "$results/$t"
  printf '  %-12s %4d s  %s\n' "$t" "$took" "$([ "$rc" -eq 0 ] && echo ok || echo FAILED)"
  [ "$rc" -eq 0 ] || fail=1
done
printf '  %-12s %4d s\n' "wall" "$(( $(date +%s) - t_all ))"
exit $fail
