"""Checkpoints on disk, with history: every file written atomically (tmp + fsync + os.replace).

A room's checkpoints are ``DIR/ROOM.history/step-<step, 20 digits>-<digest, 12 hex>.ckpt``;
``DIR/ROOM.ckpt`` is the newest of them (a hard link, or a copy where links fail), so a reader
that knows one file (``load``, ``load_latest``: failover from a shared directory) finds the
newest. :class:`CheckpointStore` keeps the newest ``keep`` plus the best by held-out accuracy and
prunes the rest (README "Checkpoints and stopping").

File layout: ``b"TCCK1\\n"``, a u32 LE length, that many bytes of JSON metadata (``id``, step,
digest, loss, n, job_hash, accuracy, ...), then the parameters as float32 little-endian bytes,
then the leader's optimizer state (float32 LE, as many values as the room's optimizer keeps; none
for SGD): the server stores and serves it without reading it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import tempfile
from array import array
from typing import Callable

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
    """The room's newest checkpoint file (``DIR/ROOM.ckpt``)."""
    return os.path.join(directory, f"{room}.ckpt")


def history_dir(directory: str, room: str) -> str:
    """The directory of the room's kept checkpoints (``DIR/ROOM.history``)."""
    return os.path.join(directory, f"{room}.history")


#: A checkpoint id: ``<step>-<first 12 hex digits of the sha256 of its parameters>``.
ID_RE = re.compile(r"(0|[1-9][0-9]{0,18})-[0-9a-f]{12}\Z")


def checkpoint_id(step: int, digest: str) -> str:
    return f"{int(step)}-{digest[:12]}"


def _file_for(directory: str, room: str, meta: dict) -> str:
    return os.path.join(history_dir(directory, room), f"step-{int(meta['step']):020d}-{meta['digest'][:12]}.ckpt")


def _write_atomic(path: str, blob_head: bytes, data: bytes) -> None:
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ckpt.", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob_head)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _head(meta: dict) -> bytes:
    head = json.dumps(meta, sort_keys=True).encode()
    return MAGIC + struct.pack("<I", len(head)) + head


def save(directory: str, room: str, meta: dict, data: bytes) -> None:
    """Write one checkpoint of ``room`` atomically into its history and make it the newest
    (``ROOM.ckpt``): readers see the old newest file or the new one, never a part."""
    meta = dict(meta)
    meta.setdefault("id", checkpoint_id(meta["step"], meta["digest"]))
    path = _file_for(directory, room, meta)
    _write_atomic(path, _head(meta), data)
    newest = path_for(directory, room)
    tmp = os.path.join(directory, f".{room}.ckpt.link")
    try:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        os.link(path, tmp)
        os.replace(tmp, newest)
    except OSError:          # no hard links here (some shared file systems): a copy
        _write_atomic(newest, _head(meta), data)


def _keep_in_history(directory: str, room: str, path: str, meta: dict, data: bytes) -> str:
    """A copy of ``path`` (a ``ROOM.ckpt`` another job wrote) under its name in ``ROOM.history/``
    (a hard link, else a copy), where it is read like that job's other checkpoints, before this
    job's first checkpoint replaces ``ROOM.ckpt``; returns that file's path."""
    kept = _file_for(directory, room, meta)
    if not os.path.exists(kept):
        os.makedirs(os.path.dirname(kept), exist_ok=True)
        try:
            os.link(path, kept)
        except FileExistsError:
            pass
        except OSError:          # no hard links here: a copy
            _write_atomic(kept, _head(meta), data)
    return kept


def _read(path: str) -> tuple[dict, bytes] | None:
    try:
        with open(path, "rb") as f:
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
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 1 << 63:
        return None
    meta.setdefault("id", checkpoint_id(step, meta["digest"]))
    return meta, data


def _scan(directory: str, room: str) -> list[str]:
    h = history_dir(directory, room)
    try:
        names = sorted(n for n in os.listdir(h) if n.startswith("step-") and n.endswith(".ckpt"))
    except OSError:
        names = []
    return [os.path.join(h, n) for n in names] + [path_for(directory, room)]


def load_latest(directory: str, room: str,
                accept: Callable[[dict, bytes], bool] | None = None) -> tuple[dict, bytes] | None:
    """The newest valid checkpoint of ``room`` (highest step among the readable files whose
    digest matches and that ``accept(meta, data)`` takes), or ``None``; never raises."""
    best = None
    for path in _scan(directory, room):
        got = _read(path)
        if got is not None and (accept is None or accept(*got)) and (best is None or got[0]["step"] > best[0]["step"]):
            best = got
    return best


def load(directory: str, room: str) -> tuple[dict, bytes] | None:
    """The newest checkpoint of ``room`` (:func:`load_latest`), or ``None`` (never raises)."""
    return load_latest(directory, room)


#: Meta fields listed by ``CheckpointStore.list`` (the operator's view of the history).
LIST_FIELDS = ("id", "step", "digest", "accuracy", "loss", "final", "time", "rank", "term")


class CheckpointStore:
    """One room's checkpoint history: the newest ``keep`` checkpoints plus the best by held-out
    accuracy (ties: the newer), on disk when ``directory`` is set (else in memory).

    Args:
        directory: the checkpoint directory, or ``None`` (in memory only).
        room: the room name.
        keep: how many of the newest to keep (>= 1).
        accept: ``accept(meta, data) -> bool``: which files on disk belong to this room's job
            (model size, job hash, finite values); the others are left alone.
    """

    def __init__(self, directory: str | None, room: str, *, keep: int = 5,
                 accept: Callable[[dict, bytes], bool] | None = None) -> None:
        self.directory = directory
        self.room = room
        self.keep = keep
        self.entries: list[dict] = []           # metas, ascending step
        self._data: dict[str, bytes] = {}       # id -> parameters (all in memory; newest on disk)
        #: readable checkpoint files of this room that ``accept`` refused (another job's), and the
        #: newest of their steps: serve says why the room does not resume from them
        self.n_refused, self.refused_step = 0, None
        #: where the newest of them is kept (in ``ROOM.history/``: ``ROOM.ckpt`` becomes this job's
        #: newest at its first checkpoint), or None
        self.refused_kept: str | None = None
        #: this room's checkpoint files that could not be read (truncated, damaged): serve says so
        self.unreadable: list[str] = []
        if directory:
            seen: dict[str, tuple[dict, bytes]] = {}
            refused: dict[str, int] = {}
            refused_in_history: dict[str, str] = {}     # id -> its file in ROOM.history/
            newest = path_for(directory, room)
            for path in _scan(directory, room):
                got = _read(path)
                if got is None:
                    if os.path.exists(path):
                        self.unreadable.append(os.path.basename(path))
                elif accept is None or accept(*got):
                    seen.setdefault(got[0]["id"], got)
                else:
                    refused[got[0]["id"]] = got[0]["step"]
                    if path != newest:
                        refused_in_history[got[0]["id"]] = path
                    else:   # ROOM.ckpt, which this job's first checkpoint replaces: keep it in the history
                        refused_in_history.setdefault(got[0]["id"], _keep_in_history(directory, room, path, *got))
            self.n_refused, self.refused_step = len(refused), max(refused.values(), default=None)
            if refused:
                self.refused_kept = refused_in_history.get(max(refused, key=lambda k: refused[k]))
            for meta, data in sorted(seen.values(), key=lambda g: g[0]["step"]):
                self.entries.append(meta)
                self._data[meta["id"]] = data
            self._prune()

    def latest_meta(self) -> dict | None:
        return self.entries[-1] if self.entries else None

    def latest(self) -> tuple[dict, bytes] | None:
        """The newest checkpoint ``(meta, float32 LE bytes)``, or None."""
        m = self.latest_meta()
        return None if m is None else self.get(m["id"])

    def best_meta(self) -> dict | None:
        """The kept checkpoint of the highest held-out accuracy (ties: the newer), or None."""
        scored = [m for m in self.entries if isinstance(m.get("accuracy"), (int, float))]
        return max(scored, key=lambda m: (m["accuracy"], m["step"])) if scored else None

    def get(self, ckpt_id: str) -> tuple[dict, bytes] | None:
        for m in self.entries:
            if m["id"] == ckpt_id:
                data = self._data.get(ckpt_id)
                if data is None and self.directory:
                    got = _read(_file_for(self.directory, self.room, m))
                    data = None if got is None else got[1]
                return None if data is None else (m, data)
        return None

    def list(self) -> list[dict]:
        """The kept checkpoints, newest first: ``LIST_FIELDS`` plus ``best`` (bool)."""
        best = self.best_meta()
        return [{**{k: m.get(k) for k in LIST_FIELDS}, "best": best is not None and m["id"] == best["id"]}
                for m in reversed(self.entries)]

    def add(self, meta: dict, data: bytes) -> dict:
        """Store a checkpoint (its ``step`` above the newest's: the caller checks) and prune.

        Returns:
            the stored meta, with its ``id``.
        """
        meta = dict(meta)
        meta["id"] = checkpoint_id(meta["step"], meta["digest"])
        if self.directory:
            save(self.directory, self.room, meta, data)
        self._data[meta["id"]] = data
        self.entries = [*self.entries, meta]
        self._prune()
        return meta

    def mark_final(self, ckpt_id: str) -> dict | None:
        """Mark a stored checkpoint as the run's final one (an upload of the same step and
        digest with the final flag); returns its meta, or None."""
        for i, m in enumerate(self.entries):
            if m["id"] == ckpt_id:
                m = {**m, "final": True}
                if self.directory:
                    got = self.get(ckpt_id)
                    if got is not None:
                        save(self.directory, self.room, m, got[1])
                entries = list(self.entries)
                entries[i] = m
                self.entries = entries
                return m
        return None

    def _prune(self) -> None:
        best = self.best_meta()
        keep_ids = {m["id"] for m in self.entries[-self.keep:]}
        if best is not None:
            keep_ids.add(best["id"])
        gone = [m for m in self.entries if m["id"] not in keep_ids]
        self.entries = [m for m in self.entries if m["id"] in keep_ids]
        newest = self.entries[-1]["id"] if self.entries else None
        for m in gone:
            self._data.pop(m["id"], None)
            if self.directory:
                try:
                    os.unlink(_file_for(self.directory, self.room, m))
                except OSError:
                    pass
        if self.directory:   # on disk: only the newest stays in memory (the others are read back)
            for k in list(self._data):
                if k != newest:
                    del self._data[k]
