"""FrameReader: chunks in, messages out; untrusted bytes never raise (docs/INTERFACES.md, "Wire").

Reassembly is bounded per sender and in total: at most
``limits.max_incomplete_frames_per_sender`` partial frames and ``limits.sender_budget_bytes``
bytes per sender (that sender's oldest partial frame is evicted, counted
``reassembly_overflow``), ``limits.max_incomplete_bytes`` over all senders (the sender holding
the most loses its oldest), each for at most ``limits.reassembly_timeout_ms`` (counted
``reassembly_timeout``). So one peer's never-completed frames cost a reader at most its own
budget, and never evict another peer's frames while that peer holds less. A frame's declared size is checked against ``limits.max_frame_bytes``
before its first byte is stored.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from .._compat import np
from ..errors import RemoteProtocolError
from . import limits as L
from .chunk import CHUNK_HEADER, Route, parse_route
from .frame import BODY_ALIGN_PAD, decode_body
from .vec import resolve_numpy


#: what a held part of a partial frame is charged at least, bytes: a part is a view of its chunk
#: (header, buffer object, the dict slot), so a peer that cut frames into 1-byte chunks made the
#: reader hold 160 MB while 256 KiB was charged (a hostile trial); honest chunks are far longer
PART_MIN_CHARGE_BYTES = 512


class _Partial:
    __slots__ = ("route", "first_ms", "parts", "n_bytes", "charged")

    def __init__(self, route: Route, now_ms: float) -> None:
        self.route = route
        self.first_ms = now_ms
        self.parts: dict[int, Any] = {}
        self.n_bytes = 0
        self.charged = 0   # bytes charged to the budgets (PART_MIN_CHARGE_BYTES per part at least)


class FrameReader:
    """Reassemble and decode chunks from any number of senders.

    Args:
        limits: bounds on what a peer can make this reader hold.
        use_numpy: ``None`` = numpy when importable; decoded vectors are numpy float32 arrays on
            the numpy path, ``array('f')`` otherwise.

    Attributes:
        drops: dropped chunks/frames by reason (:data:`tabcohort.wire.limits.DROP_REASONS`).
        n_frames: frames decoded.
    """

    def __init__(self, limits: L.WireLimits | None = None, *, use_numpy: bool | None = None) -> None:
        self.limits = limits or L.WireLimits()
        self.use_numpy = resolve_numpy(use_numpy)
        self.drops: dict[str, int] = {}
        self.n_frames = 0
        self._partial: OrderedDict[tuple[int, int], _Partial] = OrderedDict()
        self._per_sender: dict[int, int] = {}
        self._sender_bytes: dict[int, int] = {}
        self._held_bytes = 0

    def _drop(self, reason: str, n: int = 1) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + n

    def _remove(self, key: tuple[int, int]) -> _Partial:
        p = self._partial.pop(key)
        self._held_bytes -= p.charged
        s = key[0]
        left = self._per_sender[s] - 1
        if left:
            self._per_sender[s] = left
            self._sender_bytes[s] -= p.charged
        else:
            del self._per_sender[s]
            del self._sender_bytes[s]
        return p

    def held_bytes(self, sender: int | None = None) -> int:
        """Partial-frame bytes held (for ``sender``, or in total)."""
        return self._held_bytes if sender is None else self._sender_bytes.get(sender, 0)

    def _make_room(self, sender: int, key: tuple[int, int], n: int) -> bool:
        """Evict partial frames so ``n`` more bytes of ``sender``'s frame ``key`` fit the
        per-sender and total budgets; False when ``key`` itself had to go."""
        lim = self.limits
        budget = lim.sender_budget_bytes
        while self._sender_bytes.get(sender, 0) and self._sender_bytes[sender] + n > budget:
            oldest = next(k for k in self._partial if k[0] == sender)
            self._remove(oldest)
            self._drop(L.REASSEMBLY_OVERFLOW)
            if oldest == key:
                return False
        while self._partial and self._held_bytes + n > lim.max_incomplete_bytes:
            heavy = max(self._sender_bytes, key=self._sender_bytes.__getitem__)
            oldest = next(k for k in self._partial if k[0] == heavy)
            self._remove(oldest)
            self._drop(L.REASSEMBLY_OVERFLOW)
            if oldest == key:
                return False
        return True

    @property
    def n_incomplete(self) -> int:
        """Partial frames currently held."""
        return len(self._partial)

    def expire(self, now_ms: float) -> int:
        """Drop partial frames first seen more than ``reassembly_timeout_ms`` before ``now_ms``.

        Returns:
            How many frames were dropped (each counted ``reassembly_timeout``).
        """
        n = 0
        limit = now_ms - self.limits.reassembly_timeout_ms
        while self._partial:
            key, p = next(iter(self._partial.items()))
            if p.first_ms > limit:
                break
            self._remove(key)
            n += 1
        if n:
            self._drop(L.REASSEMBLY_TIMEOUT, n)
        return n

    def feed(self, chunk: Any, *, now_ms: float, owned: bool = False) -> list[dict]:
        """Take one chunk; return the messages it completes (zero or one).

        Args:
            chunk: bytes-like, exactly as received from the transport.
            now_ms: the caller's clock, milliseconds (for reassembly timeouts).
            owned: ``chunk`` is writable memory that nothing else holds or reuses: a frame it
                carries whole decodes its float32 vectors as views of it where they land
                4-aligned (as a reassembled frame's do in the reader's own buffer), not as
                copies.

        Returns:
            Decoded messages: dicts with ``t``, ``from``, ``to`` (only when addressed) and the
            type's fields (INTERFACES.md, "Messages"). Never raises for bad input.
        """
        if self._partial:
            self.expire(now_ms)
        try:
            r = parse_route(chunk, self.limits)
        except RemoteProtocolError as e:
            self._drop(e.reason)
            return []
        mv = memoryview(chunk)
        payload = (mv if mv.format == "B" else mv.cast("B"))[CHUNK_HEADER.size :]
        if r.count == 1:
            if len(payload) != r.frame_len:
                self._drop(L.LENGTH_MISMATCH)
                return []
            return self._decode(r, payload, owned=owned)
        body = self._reassemble(r, payload, now_ms)
        return [] if body is None else self._decode(r, body, owned=True)

    def _reassemble(self, r: Route, payload: memoryview, now_ms: float) -> Any:
        key = (r.sender, r.frame_id)
        lim = self.limits
        p = self._partial.get(key)
        # the part that completes its frame leaves at once: charged as it is
        cost = len(payload) if (0 if p is None else len(p.parts)) + 1 >= r.count else max(len(payload),
                                                                                      PART_MIN_CHARGE_BYTES)
        if p is None:
            if self._per_sender.get(r.sender, 0) >= lim.max_incomplete_frames_per_sender:
                oldest = next(k for k in self._partial if k[0] == r.sender)
                self._remove(oldest)
                self._drop(L.REASSEMBLY_OVERFLOW)
            self._make_room(r.sender, key, cost)
            p = self._partial[key] = _Partial(r, now_ms)
            self._per_sender[r.sender] = self._per_sender.get(r.sender, 0) + 1
            self._sender_bytes.setdefault(r.sender, 0)
        else:
            q = p.route
            if (q.count, q.frame_len, q.recipient) != (r.count, r.frame_len, r.recipient):
                self._remove(key)
                self._drop(L.BAD_CHUNK)
                return None
            if r.index in p.parts:
                self._drop(L.DUPLICATE_CHUNK)
                return None
            if not self._make_room(r.sender, key, cost):
                return None
        if p.n_bytes + len(payload) > r.frame_len:
            self._remove(key)
            self._drop(L.LENGTH_MISMATCH)
            return None
        p.parts[r.index] = payload
        p.n_bytes += len(payload)
        p.charged += cost
        self._held_bytes += cost
        self._sender_bytes[r.sender] += cost
        if len(p.parts) < r.count:
            return None
        self._remove(key)
        if p.n_bytes != r.frame_len:
            self._drop(L.LENGTH_MISMATCH)
            return None
        if not self.use_numpy:
            return b"".join(p.parts[i] for i in range(r.count))
        # One copy, into a buffer of this reader's own: its f32 vectors decode as views of it
        # (frame.BODY_ALIGN_PAD puts them 4-aligned), not as a second copy.
        buf = np.empty(BODY_ALIGN_PAD + r.frame_len, dtype=np.uint8)
        body = memoryview(buf)[BODY_ALIGN_PAD:]
        o = 0
        for i in range(r.count):
            part = p.parts[i]
            body[o:o + len(part)] = part
            o += len(part)
        return body

    def _decode(self, r: Route, body: Any, *, owned: bool = False) -> list[dict]:
        try:
            msg = decode_body(body, limits=self.limits, use_numpy=self.use_numpy, owned=owned)
        except RemoteProtocolError as e:
            self._drop(e.reason)
            return []
        msg["from"] = r.sender
        if r.recipient is not None:
            msg["to"] = r.recipient
        self.n_frames += 1
        return [msg]
