"""Vectors on both paths: float32 data as ``array.array('f')`` (stdlib) or a numpy array.

INTERFACES.md, "Messages": a *vector* is float32 data. On encode it may be a numpy array, an
``array.array('f'|'d')`` or a list of floats; on decode it is a numpy ``float32`` array when the
numpy path is in use, else ``array.array('f')``. Every byte on the wire is little-endian.
"""

from __future__ import annotations

import array
import math
import sys
from typing import Any

from .._compat import np
from ..errors import ConfigError, LocalProtocolError

LITTLE_ENDIAN = sys.byteorder == "little"


def resolve_numpy(use_numpy: bool | None) -> bool:
    """Decide whether the numpy path is used.

    Args:
        use_numpy: ``None`` = numpy when importable (see :mod:`tabcohort._compat`); ``True``
            forces numpy; ``False`` forces the stdlib path.

    Raises:
        ConfigError: ``use_numpy=True`` but numpy is not importable.
    """
    if use_numpy is None:
        return np is not None
    if use_numpy and np is None:
        raise ConfigError("use_numpy", use_numpy, "numpy is not importable here")
    return bool(use_numpy)


def _check_no_new_inf(src: Any, n_inf_out: int) -> None:
    n_inf_in = 0
    for v in src:
        if v in (math.inf, -math.inf):
            n_inf_in += 1
    if n_inf_out != n_inf_in:
        raise LocalProtocolError("vector has finite values outside the float32 range")


def as_f32_py(vec: Any) -> array.array:
    """The vector as ``array.array('f')`` (native order; a copy only when needed).

    Raises:
        LocalProtocolError: a finite input value overflows float32 (it would become inf).
    """
    if isinstance(vec, array.array) and vec.typecode == "f":
        return vec
    if np is not None and isinstance(vec, np.ndarray):
        if vec.dtype == np.float32:
            out = array.array("f")
            out.frombytes(np.ascontiguousarray(vec, dtype="=f4").tobytes())
            return out
        vec = vec.tolist()
    out = array.array("f", vec)  # double -> float: round to nearest even, overflow -> inf
    if not math.isfinite(sum(out)):
        _check_no_new_inf(vec, sum(1 for v in out if v in (math.inf, -math.inf)))
    return out


def as_f32_np(vec: Any) -> Any:
    """The vector as a contiguous numpy ``float32`` array of shape (n,).

    Raises:
        LocalProtocolError: a finite input value overflows float32, or the input is not 1-D.
    """
    if isinstance(vec, np.ndarray) and vec.dtype == np.float32:
        out = np.ascontiguousarray(vec)
    else:
        src = np.asarray(vec, dtype=np.float64) if not isinstance(vec, np.ndarray) else vec
        with np.errstate(over="ignore"):
            out = np.ascontiguousarray(src, dtype=np.float32)
        if src.dtype != np.float32 and np.count_nonzero(np.isinf(out)) != np.count_nonzero(np.isinf(src)):
            raise LocalProtocolError("vector has finite values outside the float32 range")
    if out.ndim != 1:
        raise LocalProtocolError(f"vector must be 1-D, got shape {out.shape}")
    return out


def le_bytes_py(a: array.array) -> bytes:
    """Little-endian bytes of an ``array.array`` (``'f'``, ``'H'``, ``'I'``, ...)."""
    if LITTLE_ENDIAN:
        return a.tobytes()
    b = array.array(a.typecode, a)
    b.byteswap()
    return b.tobytes()


def from_le_bytes_py(typecode: str, data: Any) -> array.array:
    """An ``array.array(typecode)`` from little-endian bytes (length a multiple of itemsize)."""
    a = array.array(typecode)
    a.frombytes(data)
    if not LITTLE_ENDIAN:
        a.byteswap()
    return a


def f32_view(data: Any) -> Any:
    """A writable numpy float32 view of little-endian float32 bytes, or ``None`` where a view
    cannot stand for a decoded vector (no numpy, a big-endian machine, bytes not 4-aligned or
    read-only). Only for bytes that nothing else holds or reuses (a reader's own reassembly
    buffer): the vector and the buffer are then one."""
    if np is None or not LITTLE_ENDIAN:
        return None
    a = np.frombuffer(data, dtype=np.float32)
    return a if a.flags.aligned and a.flags.writeable else None


def f32_vector(data: Any, use_numpy: bool) -> Any:
    """Decode little-endian float32 bytes into the vector type of the chosen path (a copy)."""
    if use_numpy:
        return np.frombuffer(data, dtype="<f4").astype(np.float32)
    return from_le_bytes_py("f", data)


def vec_len(vec: Any) -> int:
    """Number of elements of a vector given on encode."""
    return len(vec)
