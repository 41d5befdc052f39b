"""Suite-wide hooks for the test tiers (keep minimal; fixtures belong next to their tests).

- ``needs_numpy``: skipped when numpy is not importable (``tabcohort._compat.np is None``):
  the no-numpy native tier (tests/no_numpy/run.sh), the Pyodide tier (tests/pyodide/run.sh),
  or ``TABCOHORT_NO_NUMPY=1``.
- ``needs_loop``: skipped under Pyodide (``sys.platform == "emscripten"``): its WebLoop cannot
  run an asyncio loop to completion from synchronous code (``asyncio.run`` and friends).
"""

from __future__ import annotations

import pathlib
import sys

import pytest

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
