#!/usr/bin/env bash
# Pyodide tier: the project's pytest tests inside Pyodide 314 (Python 3.14, no numpy) under
# Node 20, offline once the caches exist. Arguments go to pytest, e.g.
#   bash tests/pyodide/run.sh tests/unit tests/conformance -q -p no:cacheprovider
# Steps: npm ci into node_modules/ (if missing or stale), pip download the pinned pure-Python
# wheels into .cache/pyodide-wheels/ (if missing or the pins changed), then
# node tests/pyodide/run.mjs "$@". Exit code: pytest's (3 = runner crash, 4 = setup failure).
# Env: PYTHON (host python for pip, default python3), TABCOHORT_PYODIDE_WHEELS (wheel cache dir),
#      TABCOHORT_PYODIDE_BUNDLE=0 (no precompiled stdlib / site-packages: slower, for debugging).
# First run on a machine also builds the precompiled stdlib and site-packages zips (~10 s, once).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$repo"
PY="${PYTHON:-python3}"
log() { echo "[pyodide-tier] $*" >&2; }
t0=$(date +%s%N)

command -v node >/dev/null || { log "node not found (need Node >= 20)"; exit 4; }
node_major=$(node -p 'process.versions.node.split(".")[0]')
[ "$node_major" -ge 20 ] || { log "Node $(node --version) too old (need >= 20)"; exit 4; }

# 1. Node deps, from package-lock.json. Reinstall when the lock changed since the last install.
if [ ! -f node_modules/pyodide/pyodide.mjs ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
  log "npm ci (pyodide from package-lock.json)"
  npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >&2
fi

# 2. Wheels for pytest & co. Refetch when requirements.txt differs from the one fetched with.
wheels="${TABCOHORT_PYODIDE_WHEELS:-.cache/pyodide-wheels}"
req="$here/requirements.txt"
if ! cmp -s "$req" "$wheels/requirements.txt"; then
  log "pip download -> $wheels"
  rm -rf "$wheels.tmp"
  mkdir -p "$wheels.tmp"
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.14 --implementation py --platform any \
    -d "$wheels.tmp" -r "$req" 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
  cp "$req" "$wheels.tmp/requirements.txt"
  rm -rf "$wheels"
  mv "$wheels.tmp" "$wheels"
fi
t1=$(date +%s%N)
log "setup checks $(( (t1 - t0) / 1000000 )) ms"

# 3. Run. run.mjs prints boot / unpack / pytest timings on stderr.
export TABCOHORT_PYODIDE_WHEELS="$wheels"
exec node "$here/run.mjs" "$@"
