"""Checkpoints on disk: one file per room, written atomically (tmp + fsync + os.replace).

File layout: ``b"TCCK1\\n"``, a u32 LE length, that many bytes of JSON metadata (step, digest,
loss, n, ...), then the parameters as float32 little-endian bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from array import array

from tabcohort._compat import np

MAGIC = b"TCCK1\n"
_EXP_MASK = 0x7F800000   # IEEE 754 binary32: all exponent bits set = +-inf or NaN


def non_finite_f32(data: bytes) -> tuple[int, int | None]:
    """Count the float32 little-endian values in ``data`` that are NaN or +-inf.

    Reads bit patterns only (exponent bits all ones, IEEE 754-2019 section 3.4); the parameters
    are never decoded as numbers, so the server stays out of the model's business.

    Args:
        data: float32 LE bytes; its length must be a multiple of 4.

    Returns:
        ``(count, first_index)``; ``(0, None)`` when every value is finite.

    Raises:
        ValueError: the length is not a multiple of 4.
    """
    if len(data) % 4:
        raise ValueError(f"{len(data)} bytes is not a whole number of float32 values")
    if np is not None:
        bad = np.flatnonzero((np.frombuffer(data, dtype="<u4") & _EXP_MASK) == _EXP_MASK)
        return int(bad.size), (int(bad[0]) if bad.size else None)
    words = array("I")
    if words.itemsize != 4:  # pragma: no cover - every CPython platform we run on has 4
        words = array("L")
    words.frombytes(data)
    if struct.pack("=I", 1) != struct.pack("<I", 1):  # pragma: no cover - big-endian host
        words.byteswap()
    count, first = 0, None
    for i, w in enumerate(words):
        if w & _EXP_MASK == _EXP_MASK:
            count += 1
            if first is None:
                first = i
    return count, first


def path_for(directory: str, room: str) -> str:
    return os.path.join(directory, f"{room}.ckpt")


def save(directory: str, room: str, meta: dict, data: bytes) -> None:
    """Write the checkpoint of ``room`` atomically: readers see the old file or the new one."""
    os.makedirs(directory, exist_ok=True)
    head = json.dumps(meta, sort_keys=True).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{room}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(head)) + head)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path_for(directory, room))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load(directory: str, room: str) -> tuple[dict, bytes] | None:
    """The latest checkpoint of ``room``, or ``None`` (missing or unreadable: never raises)."""
    try:
        with open(path_for(directory, room), "rb") as f:
            blob = f.read()
    except OSError:
        return None
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 4:
        return None
    (n,) = struct.unpack_from("<I", blob, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        meta = json.loads(blob[start:start + n])
    except ValueError:
        return None
    data = blob[start + n:]
    if not isinstance(meta, dict) or hashlib.sha256(data).hexdigest() != meta.get("digest"):
        return None
    return meta, data
