#!/usr/bin/env bash
# No-numpy native tier: pytest on the host CPython (3.11) with numpy made unimportable by
# tests/no_numpy/sitecustomize.py (a sys.meta_path finder), not merely disabled by
# TABCOHORT_NO_NUMPY. Arguments go to pytest, e.g.
#   bash tests/no_numpy/run.sh tests/unit tests/conformance -q -p no:cacheprovider
# Exit code: pytest's.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$repo"
PY="${PYTHON:-python3}"

export PYTHONPATH="$here:$repo/client_py${PYTHONPATH:+:$PYTHONPATH}"
unset TABCOHORT_NO_NUMPY  # the block must do the work, not the variable

# Sanity check: the blocker is active, and tabcohort took its no-numpy path.
"$PY" - <<'PY'
import sys
try:
    import numpy  # noqa: F401
except ImportError as e:
    print(f"[no-numpy-tier] Python {sys.version.split()[0]}: import numpy -> {type(e).__name__}: {e}", file=sys.stderr)
else:
    sys.exit("[no-numpy-tier] numpy imported: sitecustomize.py is not in effect (another sitecustomize first on sys.path?)")
import tabcohort._compat as c
assert c.np is None and not c.HAVE_NUMPY, "tabcohort._compat found numpy"
PY

exec "$PY" -m pytest "$@"
