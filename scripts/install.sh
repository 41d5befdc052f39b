#!/usr/bin/env bash
# Installs what tabcohort itself needs (idempotent, quiet): the package, editable, with its
# runtime extras (digits: scikit-learn, which ships the data set; lan: zeroconf for discovery) and the Node
# packages (npm ci: Pyodide served to tabs, uPlot for the page's charts). Nothing for the tests:
# scripts/install-test.sh adds those.
# Prerequisites: Python >= 3.11 with pip; Node >= 20 with npm (without it the page boots Pyodide
# from the public CDN instead of this server).
# Usage: bash scripts/install.sh        (PYTHON=python3.12 to choose the interpreter)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "[install] tabcohort needs Python >= 3.11; '$PY' is $("$PY" --version 2>&1 || echo missing) (set PYTHON=...)" >&2
  exit 1
fi
echo "[install] pip install -e .[digits,lan]" >&2
"$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore -e ".[digits,lan]"
# pyenv installs console scripts behind shims: make `tabcohort` visible on PATH now
if command -v pyenv >/dev/null; then pyenv rehash || true; fi
if ! command -v tabcohort >/dev/null; then
  echo "[install] note: 'tabcohort' is not on PATH; use '$PY -m tabcohort' or add $("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))') to PATH" >&2
fi
if command -v npm >/dev/null; then
  major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
  [ "$major" -ge 20 ] || echo "[install] note: Node $(node --version 2>/dev/null) is older than 20 (the Pyodide test tier needs 20)" >&2
  if [ -L node_modules ]; then
    # a shared copy (a git worktree's link to another tree's): npm ci would empty its target
    [ -f node_modules/pyodide/pyodide.mjs ] \
      || echo "[install] note: node_modules is a link to an incomplete copy; run npm ci where it points" >&2
  elif [ ! -f node_modules/pyodide/pyodide.mjs ] || [ ! -f node_modules/uplot/dist/uPlot.iife.min.js ] \
     || [ package-lock.json -nt node_modules/.package-lock.json ]; then
    echo "[install] npm ci (Pyodide, uPlot, axe-core)" >&2
    npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >&2
  fi
else
  echo "[install] note: npm not found: tabs will load Pyodide from the public CDN (install Node >= 20 for a local copy)" >&2
fi
