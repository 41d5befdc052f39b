"""Optional numpy.

``np`` is the numpy module, or ``None`` when numpy cannot be imported (a tab without numpy,
or the test tier that makes numpy unimportable). Every module that can use numpy imports it
from here, so both paths are chosen in one place.
"""

from __future__ import annotations

import os

np = None
if os.environ.get("TABCOHORT_NO_NUMPY", "") not in ("1", "true", "yes"):
    try:  # pragma: no cover - depends on the environment
        import numpy as np  # type: ignore[no-redef]
    except ImportError:  # pragma: no cover
        np = None

HAVE_NUMPY = np is not None
