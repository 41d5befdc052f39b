#!/usr/bin/env bash
# Runs every CI test tier in order and prints each tier's wall time.
#   unit        native CPython with numpy: wire, codecs, fuzz, model, protocol rules, conformance
#   sim         seeded discrete-event simulations of many ranks (invariants from the bus log)
#   runtime     the asyncio driver under virtual time (looptime)
#   pg          the fixed-world process group: collectives across 2-4 real processes (TCP)
#   no-numpy    unit + conformance + sim natively with numpy made unimportable
#   pyodide     unit + conformance + sim inside Pyodide 314 (Python 3.14) under Node 20
#   browser     real Chromium + real Pyodide tabs joining a real server (Playwright)
#   mutations   breaks each PROTOCOL.md rule on purpose; its named test must fail
#   container   builds the Docker image and runs the compose demo for real (root; installs docker.io)
# Usage: bash scripts/test.sh [tier ...]   (default: all tiers)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/client_py:$PWD/server${PYTHONPATH:+:$PYTHONPATH}"
common=(-q -p no:cacheprovider --timeout=600)
tiers=("$@")
[ ${#tiers[@]} -eq 0 ] && tiers=(unit sim runtime integration pg no-numpy pyodide browser mutations container)

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

declare -A took status
run_tier() {
  local name=$1; shift
  echo "=== tier $name: $*"
  local t0=$(date +%s)
  "$@"
  local rc=$?
  [ $rc -eq 5 ] && rc=0   # pytest: no tests collected in this tier
  took[$name]=$(( $(date +%s) - t0 ))
  status[$name]=$rc
  echo "=== tier $name: exit $rc in ${took[$name]} s"
}

for t in "${tiers[@]}"; do
  case $t in
    unit) run_tier unit "$PY" -m pytest tests/unit tests/conformance -m "not slow and not integration" "${common[@]}" ;;
    sim) run_tier sim "$PY" -m pytest tests/sim -m "not slow" "${common[@]}" ;;
    runtime) run_tier runtime "$PY" -m pytest tests/runtime -m "not slow" "${common[@]}" ;;
    integration)
      if [ -d tests/integration ]; then
        run_tier integration netns "$PY" -m pytest tests/integration -m "not slow" "${common[@]}"
      fi ;;
    pg) run_tier pg netns "$PY" -m pytest tests/pg -m "not slow" "${common[@]}" ;;
    no-numpy) run_tier no-numpy bash tests/no_numpy/run.sh tests/unit tests/conformance tests/sim \
                -m "not slow and not integration" "${common[@]}" ;;
    pyodide) run_tier pyodide bash tests/pyodide/run.sh tests/unit tests/conformance tests/sim \
                -m "not slow and not integration" -q -p no:cacheprovider ;;
    browser) TABCOHORT_BROWSER_REQUIRED=1 run_tier browser "$PY" -m pytest tests/browser -m "browser and not slow" "${common[@]}" ;;
    mutations) run_tier mutations "$PY" tests/mutations/run.py ;;
    container) run_tier container bash tests/container/run.sh ;;
    *) echo "unknown tier $t"; exit 2 ;;
  esac
done

echo
echo "tier times:"
fail=0
for t in "${tiers[@]}"; do
  [ -n "${took[$t]:-}" ] || continue
  printf '  %-12s %4d s  %s\n' "$t" "${took[$t]}" "$([ "${status[$t]}" -eq 0 ] && echo ok || echo FAILED)"
  [ "${status[$t]}" -eq 0 ] || fail=1
done
exit $fail
