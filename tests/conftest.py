"""Suite-wide hooks for the test tiers (keep minimal; fixtures belong next to their tests).

- ``needs_numpy``: skipped when numpy is not importable (``tabcohort._compat.np is None``):
  the no-numpy native tier (tests/no_numpy/run.sh), the Pyodide tier (tests/pyodide/run.sh),
  or ``TABCOHORT_NO_NUMPY=1``.
- ``needs_loop``: skipped under Pyodide (``sys.platform == "emscripten"``): its WebLoop cannot
  run an asyncio loop to completion from synchronous code (``asyncio.run`` and friends).
- Under ``CI=true`` (``.ci/run``, a fresh machine with everything installed) a skipped test is a
  **failure** unless its reason is in :data:`ALLOWED_SKIPS`: a test that silently skips on the
  machine CI uses is a test that does not exist (install what it needs instead).
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

import pytest
from typing import Any

try:  # an installed tabcohort (pip install -e .) wins; else the work tree's source
    import tabcohort
except ImportError:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "client_py"))
    import tabcohort


def pytest_configure(config: pytest.Config) -> None:
    # tests/mutations/run.py runs the suite against a mutated copy of client_py/: make sure
    # that copy, not an installed tabcohort, is what the tests import.
    import os

    expect = os.environ.get("TABCOHORT_EXPECT_SRC")
    if expect and not pathlib.Path(tabcohort.__file__).resolve().is_relative_to(pathlib.Path(expect).resolve()):
        raise pytest.UsageError(f"tabcohort imported from {tabcohort.__file__}, not from {expect}")
    # a second checkout's tests importing the first one's editable install test the wrong code,
    # and pass (a new-user trial did exactly that): say so before anything runs
    root = pathlib.Path(__file__).resolve().parent.parent
    if not expect and sys.platform != "emscripten" and \
            not pathlib.Path(tabcohort.__file__).resolve().is_relative_to(root):
        raise pytest.UsageError(
            f"tabcohort is imported from {tabcohort.__file__}, outside this checkout ({root}): these tests "
            f"would test that code. Install this checkout (pip install -e .) or run with "
            f"PYTHONPATH={root / 'client_py'}{os.pathsep}{root / 'server'}")
    if expect:
        # a mutation run needs a failure, not its smallest example: hypothesis's shrinking of a
        # caught mutation's counterexample was most of many a mutation's run
        try:
            from hypothesis import Phase, settings
        except ImportError:
            pass
        else:
            settings.register_profile("mutations", phases=[Phase.explicit, Phase.reuse, Phase.generate])
            settings.load_profile("mutations")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tabcohort._compat import np

    no_numpy = pytest.mark.skip(reason="needs numpy; not importable in this tier")
    no_loop = pytest.mark.skip(reason="needs a runnable asyncio loop; Pyodide cannot run one")
    emscripten = sys.platform == "emscripten"
    for item in items:
        if np is None and item.get_closest_marker("needs_numpy") is not None:
            item.add_marker(no_numpy)
        if emscripten and item.get_closest_marker("needs_loop") is not None:
            item.add_marker(no_loop)


def _no_numpy() -> bool:
    from tabcohort._compat import np
    return np is None


#: Skips that are legitimate on a CI machine: (reason pattern, when it holds, why). A skip whose
#: reason matches none of these (with its condition true) fails the test under CI=true.
ALLOWED_SKIPS: list[tuple[str, Any, str]] = [
    (r"^needs numpy", _no_numpy, "the no-numpy and Pyodide tiers run without numpy on purpose"),
    (r"^could not import '(numpy|sklearn)'", _no_numpy, "numpy, and scikit-learn on it, are absent by design there"),
    (r"^could not import '(aiortc|zeroconf|playwright)'", lambda: sys.platform == "emscripten",
     "native-only packages do not exist in Pyodide"),
    (r"^import-linter is a test extra", lambda: sys.platform == "emscripten",
     "the architecture check runs natively (Pyodide has no subprocesses)"),
    (r"^the worker's JS runs natively under Node", lambda: sys.platform == "emscripten",
     "the page worker's JavaScript is tested under Node natively"),
    (r"^needs a runnable asyncio loop", lambda: sys.platform == "emscripten", "Pyodide cannot run a loop to completion"),
    (r"^glibc's allocator: native tiers only", lambda: sys.platform == "emscripten",
     "a tab's Python runs on Emscripten's allocator, which tabcohort._alloc leaves alone"),
    (r"^sockets: native tiers only", lambda: sys.platform == "emscripten",
     "the direct path's TCP sockets exist natively only (a tab never opens one)"),
    (r"^JS typed arrays exist in Pyodide only$", lambda: sys.platform != "emscripten",
     "a tab's JS values exist only in Pyodide; the Pyodide tier runs those cases"),
    (r"^a subprocess: native tiers only$", lambda: sys.platform == "emscripten", "Pyodide has no subprocesses"),
    (r"^could not import 'tabcohort_server'", lambda: sys.platform == "emscripten",
     "the server never runs in a tab (Pyodide tier): its configuration is tested natively"),
    (r"^numpy is importable in this tier$", lambda: not _no_numpy(), "the check of the no-numpy tiers' setup"),
    (r"^numpy disabled by TABCOHORT_NO_NUMPY only$", lambda: True, "the check of the block itself, not the variable"),
]


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def skip_allowed(reason: str) -> bool:
    """True if a skip with this reason is legitimate here (see :data:`ALLOWED_SKIPS`)."""
    return any(re.search(pat, reason) and cond() for pat, cond, _ in ALLOWED_SKIPS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    outcome = yield
    rep = outcome.get_result()
    if not rep.skipped or not _ci() or hasattr(rep, "wasxfail"):
        return
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    reason = re.sub(r"^Skipped: ", "", reason)
    if not skip_allowed(reason):
        rep.outcome = "failed"
        rep.longrepr = (f"skipped under CI=true: {reason!r}. A required tier must not skip on the CI "
                        f"machine: install what the test needs (scripts/install-test.sh), or, if the skip "
                        f"is legitimate there, add it to ALLOWED_SKIPS in tests/conftest.py with why.")
