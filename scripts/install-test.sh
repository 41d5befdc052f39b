#!/usr/bin/env bash
# Installs everything the test tiers need on top of scripts/install.sh (idempotent):
#   - the package's test extras (pytest and plugins, hypothesis, looptime, Playwright for Python)
#   - as root on Debian/Ubuntu (apt-get): Debian's Chromium (the browser tier; Playwright drives
#     it, never `playwright install`), iptables (the cross-namespace DNS-SD tests block multicast
#     with it), iproute2 (ip netns, ss -K), util-linux (unshare: private network namespaces) and
#     redis-server (the cluster tests start a real one: tests/integration/test_cluster.py)
# The container tier installs Docker itself (tests/container/run.sh).
# Usage: bash scripts/install-test.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
bash scripts/install.sh
need=()
[ -x /usr/bin/chromium ] || need+=(chromium)
command -v iptables >/dev/null || [ -x /usr/sbin/iptables ] || need+=(iptables)
{ command -v ip >/dev/null && command -v ss >/dev/null; } || need+=(iproute2)
command -v unshare >/dev/null || need+=(util-linux)
command -v redis-server >/dev/null || [ -x /usr/bin/redis-server ] || need+=(redis-server)
if [ ${#need[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "[install-test] apt-get install ${need[*]}" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "[install-test] missing ${need[*]}: install them as root (apt-get install ${need[*]}); the tiers that need them fail under CI=true" >&2
  fi
fi
echo "[install-test] pip install -e .[test]" >&2
"$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore -e ".[test]"
