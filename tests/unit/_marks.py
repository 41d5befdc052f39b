"""Shared test marks."""

from __future__ import annotations

import pytest

from tabcohort._compat import np


def needs_numpy(fn):
    """Mark ``needs_numpy`` and skip when numpy is not importable (or TABCOHORT_NO_NUMPY=1)."""
    fn = pytest.mark.skipif(np is None, reason="needs numpy")(fn)
    return pytest.mark.needs_numpy(fn)
