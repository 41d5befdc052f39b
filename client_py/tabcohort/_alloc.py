"""The C allocator of a native process, held for frames of megabytes.

glibc's malloc serves a request above its mmap threshold (128 KiB at start, raised as large
blocks are freed, up to 32 MiB) with a fresh ``mmap`` that goes back to the kernel on ``free``,
and it trims the top of the heap once more than its trim threshold is free there. A rank makes
and drops several frame-sized buffers per round (a round of 1M float32 parameters is a 4 MB
frame: its encoding, its chunks, the reassembled body, the decoded vector, at both ends), so with
the defaults every round faults in every page of them again. Holding the mmap threshold at its
largest (32 MiB) and trimming only above 256 MiB free keeps those buffers in the heap, reused from
one round to the next (bench/bench_anchors.py, 1M float32, N = 2 over the direct path: a round of
17.7-19.2 ms took 11.0-12.1 ms with the allocator held, same run, alternating).

Native entry points call :func:`hold_allocator` once (``tabcohort rank``, ``serve``, ``simulate``
and :func:`tabcohort.pg.init_process_group`). A tab (Pyodide) has no glibc and is left alone.
``TABCOHORT_MALLOC_HOLD=0`` keeps glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Mapping

from .errors import ConfigError

#: glibc's ``mallopt`` parameters (``<malloc.h>``)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: the largest mmap threshold glibc accepts on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``), bytes
MMAP_THRESHOLD_BYTES = 32 << 20
#: free bytes at the heap's top before glibc gives them back, bytes
TRIM_THRESHOLD_BYTES = 256 << 20

_held: bool | None = None


def hold_allocator(env: Mapping[str, str] | None = None) -> bool:
    """Hold frame-sized buffers in glibc's heap (see the module docstring); once per process.

    Args:
        env: environment to read ``TABCOHORT_MALLOC_HOLD`` from (default ``os.environ``):
            ``1`` (default) or ``0``.

    Returns:
        Whether glibc took both settings (``False`` off Linux/glibc, in Pyodide, or with ``0``).

    Raises:
        ConfigError: ``TABCOHORT_MALLOC_HOLD`` is not ``0`` or ``1``.
    """
    global _held
    value = (os.environ if env is None else env).get("TABCOHORT_MALLOC_HOLD", "1")
    if value not in ("0", "1"):
        raise ConfigError("TABCOHORT_MALLOC_HOLD", value, "must be 1 (hold frame buffers in the heap) or 0")
    if value == "0" or not sys.platform.startswith("linux"):
        return False
    if _held is None:
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            _held = False
        else:
            mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
            _held = (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
                     and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    return _held
