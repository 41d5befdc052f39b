#!/usr/bin/env bash
# Installs what tabcohort needs on a fresh machine (idempotent): the package with its test
# extras (pip, editable) and the Node packages (npm ci: Pyodide for the tab tier).
# Usage: bash scripts/install.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
# Debian's Chromium for the browser tier (Playwright drives it; never `playwright install`)
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "[install] apt-get install chromium" >&2
  apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >&2
fi
echo "[install] pip install -e .[test]" >&2
"$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore -e ".[test]"
# pyenv installs console scripts behind shims: make `tabcohort` visible on PATH now
if command -v pyenv >/dev/null; then pyenv rehash || true; fi
if ! command -v tabcohort >/dev/null; then
  echo "[install] note: 'tabcohort' is not on PATH; use '$PY -m tabcohort' or add $("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))') to PATH" >&2
fi
if command -v npm >/dev/null; then
  if [ ! -f node_modules/pyodide/pyodide.mjs ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
    echo "[install] npm ci" >&2
    npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >&2
  fi
else
  echo "[install] npm not found: the Pyodide test tier will not run" >&2
fi
