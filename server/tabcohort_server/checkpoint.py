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

MAGIC = b"TCCK1\n"


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
