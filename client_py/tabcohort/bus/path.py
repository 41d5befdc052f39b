"""A path: how this rank's chunks reach one peer, sans-I/O (docs/INTERFACES.md, "Bus").

One :class:`Path` per peer of a mesh (a data channel of its own, or the server relay) and one
for the server in a star whose chunks may go on a data channel (else the WebSocket). It holds
the path's state (:class:`PathState`, changed only by :meth:`Path.opened` and
:meth:`Path.fallback`), its send queue (small frames first, :meth:`Path.enqueue`), its
counters, the peer's reported ``backlog`` and what this rank holds of the peer's bytes while
stalled. Time comes in as ``now_ms``; the bus owns the channel and does the I/O.

Rules (PROTOCOL.md, "Bus contract"):

- A one-chunk frame of at most :data:`URGENT_MAX_BYTES` overtakes queued chunks of larger
  frames (behind earlier small ones): an ordered channel would otherwise hold a heartbeat behind
  megabytes of parameters for longer than ``policy.drop``. Readers reassemble per frame and the
  protocol does not rely on order between frames.
- Chunks queued while connecting were cut for the smallest size; when the channel opens with
  a smaller max message size they are dropped (``link_down``), as are chunks queued when the path
  falls back to the relay (they were counted as sent; the count is taken back).
- A path that is not open within the connect bound, or an open one with no bytes from the peer
  for the idle bound, falls back (:meth:`Path.expired`).
- A path on the relay tries its own channel again after a backoff (:meth:`Path.fallback` sets
  ``retry_at_ms``: :data:`RETRY_BASE_MS` doubling per failed try, at most :data:`RETRY_CAP_MS`);
  while a retry comes up (:attr:`Path.retrying`) its frames keep going through the relay, so a
  try that fails again costs nothing. A loaded host that missed one connect bound is then not
  on the relay for good.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Any

from ..wire import DEFAULT_MAX_MESSAGE_BYTES

#: Frames of one chunk up to this size go ahead of queued bulk chunks on a path.
URGENT_MAX_BYTES = 2048

#: The delay before a path on the relay tries its own channel again, and the largest delay, ms.
RETRY_BASE_MS = 10_000.0
RETRY_CAP_MS = 160_000.0


class PathState(enum.Enum):
    """Where a path's chunks go. The value is what state reports and the page show (a direct
    path shows its :class:`PathKind` instead: :attr:`Path.label`)."""

    CONNECTING = "connecting"   #: the channel is being negotiated (chunks wait in the queue)
    DIRECT = "rtc"              #: on the path's own channel (a data channel, or a TCP connection)
    RELAY = "relay"             #: through the server (the channel is tried again after a backoff)


#: why a path went down when its peer closed the connection cleanly (a peer leaving: every rank
#: at a room's stop), logged without alarm
CLOSED_BY_PEER = "direct connection closed by the peer"
#: the same for a data channel: its peer closed it (a page's channel reports the same words)
CHANNEL_CLOSED = "data channel closed"


class PathKind(enum.Enum):
    """What a direct path's own channel is (the connector that makes it says)."""

    RTC = "rtc"   #: a WebRTC data channel (SCTP over DTLS; RFC 8831)
    TCP = "tcp"   #: a TCP connection of the pair's own, authenticated (docs/PROTOCOL.md, "Direct TCP path")


class Path:
    """One peer's path (see the module docstring).

    Args:
        peer: the peer's id (0: the server).
        now_ms: when the path was made (the connect bound counts from here).
        kind: what the direct channel is (:class:`PathKind`).

    Attributes:
        state: a :class:`PathState`.
        kind: a :class:`PathKind`.
        why: why it is on the relay (``None`` otherwise).
        sent / received: chunk bytes to / from the peer over any route.
        direct_sent / direct_received: the part of those that went on the data channel.
        max_message_bytes: the channel's negotiated chunk limit once open.
        up_after_ms: how long the channel took to open.
        remote_backlog: bytes of ours the peer holds unconsumed (its ``backlog`` signal).
        held_bytes: bytes of the peer's this rank holds while stalled.
        n_fallbacks: how many times the path moved to the relay.
        retry_at_ms: when the path (on the relay) may try its channel again.
        retrying: connecting again after a fallback (frames go through the relay meanwhile).
    """

    __slots__ = ("peer", "kind", "state", "why", "created_ms", "last_rx_ms", "queue", "n_urgent", "queued_bytes",
                 "max_message_bytes", "sent", "received", "direct_sent", "direct_received", "up_after_ms",
                 "remote_backlog", "held_bytes", "backlog_sent", "n_fallbacks", "retry_at_ms", "retrying")

    def __init__(self, peer: int, *, now_ms: float, kind: PathKind = PathKind.RTC) -> None:
        self.peer = peer
        self.kind = kind
        self.state = PathState.CONNECTING
        self.why: str | None = None
        self.created_ms = now_ms
        self.last_rx_ms = now_ms
        self.queue: deque[bytes] = deque()
        self.n_urgent = 0
        self.queued_bytes = 0
        self.max_message_bytes = DEFAULT_MAX_MESSAGE_BYTES
        self.sent = 0
        self.received = 0
        self.direct_sent = 0
        self.direct_received = 0
        self.up_after_ms: float | None = None
        self.remote_backlog = 0
        self.held_bytes = 0
        self.backlog_sent = 0
        self.n_fallbacks = 0
        self.retry_at_ms = 0.0
        self.retrying = False

    @property
    def label(self) -> str:
        """What reports show: ``connecting``, ``relay`` (a retry coming up included), or the
        direct kind (``rtc``, ``tcp``)."""
        if self.retrying:
            return PathState.RELAY.value   # (its frames go through the relay until it opens)
        return self.kind.value if self.state is PathState.DIRECT else self.state.value

    # ------------------------------------------------------------------ sending
    def enqueue(self, chunks: list[bytes], size: int, *, max_queue_bytes: int) -> bool:
        """Queue one frame's chunks for the channel (not on the relay). Returns ``False`` (and
        queues nothing) when the queue bound would be passed."""
        if self.queued_bytes + size > max_queue_bytes:
            return False
        if len(chunks) == 1 and size <= URGENT_MAX_BYTES:
            self.queue.insert(self.n_urgent, chunks[0])
            self.n_urgent += 1
        else:
            self.queue.extend(chunks)
        self.queued_bytes += size
        self.sent += size
        if self.state is PathState.DIRECT:
            self.direct_sent += size
        return True

    def take(self, channel_buffered: int, high_water_bytes: int) -> list[bytes]:
        """The chunks to put on the channel now: while its buffer is below ``high_water_bytes``
        (flow control on ``bufferedAmount``; a channel's ``send`` never refuses data)."""
        out: list[bytes] = []
        if self.state is not PathState.DIRECT:
            return out
        while self.queue and channel_buffered < high_water_bytes:
            c = self.queue.popleft()
            self.n_urgent = max(0, self.n_urgent - 1)
            self.queued_bytes -= len(c)
            channel_buffered += len(c)
            out.append(c)
        return out

    def pump(self, channel: Any, high_water_bytes: int) -> None:
        """Hand ``channel`` (a :class:`~tabcohort.bus.star.Channel`) the queued chunks:
        :meth:`take` at its buffer, and again for as long as a send leaves nothing buffered (a
        direct TCP path whose kernel took the chunks). One :meth:`take` per loop turn would let
        work the rank queued meanwhile (its own bucket's compute, right after a round is posted)
        hold back the rest of a frame the peer is waiting for. A channel that took nothing onto
        the wire (closing, dead, or deferring its send) is handed no more: what stays queued is
        resent on the relay if the path falls back."""
        while True:
            chunks = self.take(channel.buffered_bytes(), high_water_bytes)
            if not chunks:
                return
            if not channel.send(chunks) or channel.buffered_bytes():
                return

    def unqueue(self) -> list[bytes]:
        """Everything queued, removed (a star path that fell back resends it on the socket)."""
        out = list(self.queue)
        self._clear()
        return out

    def buffered(self, channel_buffered: int = 0) -> int:
        """Bytes not yet taken by the peer: queued, in the channel's buffer, and its backlog."""
        return self.queued_bytes + channel_buffered + self.remote_backlog

    # ------------------------------------------------------------------ receiving
    def received_chunk(self, size: int, *, direct: bool, now_ms: float) -> None:
        self.received += size
        if direct:
            self.direct_received += size
            self.last_rx_ms = now_ms

    def hold(self, size: int) -> None:
        self.held_bytes += size

    def release(self) -> None:
        self.held_bytes = 0

    def backlog_to_report(self, high_water_bytes: int) -> int | None:
        """The held byte count to signal to the peer now (moved by >= 1/8 of the high-water
        mark, or to or from 0), or ``None``."""
        n, last = self.held_bytes, self.backlog_sent
        if (n == 0) == (last == 0) and abs(n - last) < high_water_bytes // 8:
            return None
        self.backlog_sent = n
        return n

    def set_remote_backlog(self, n: object, max_bytes: int) -> bool:
        """The peer's ``backlog`` signal; ``False`` for a value that is not a byte count."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            return False
        self.remote_backlog = min(n, max_bytes)
        return True

    # ------------------------------------------------------------------ state
    def opened(self, max_message_bytes: int, *, now_ms: float) -> int:
        """The data channel is open: chunks go on it from now on. Returns the number of queued
        chunks dropped because they exceed the channel's ``max_message_bytes``."""
        if self.state is not PathState.CONNECTING:
            return 0
        self.state = PathState.DIRECT
        self.retrying = False
        self.n_fallbacks = 0
        self.max_message_bytes = max_message_bytes
        self.last_rx_ms = now_ms
        self.up_after_ms = now_ms - self.created_ms
        self.direct_sent += self.queued_bytes
        if any(len(c) > max_message_bytes for c in self.queue):
            n = len(self.queue)
            self.sent -= self.queued_bytes
            self.direct_sent -= self.queued_bytes
            self._clear()
            return n
        return 0

    def fallback(self, why: str, *, now_ms: float = 0.0) -> int | None:
        """Move to the relay; its channel may be tried again from ``retry_at_ms`` (the backoff
        of the module docstring). Returns the number of queued chunks dropped, or ``None`` when
        the path was on the relay already."""
        if self.state is PathState.RELAY:
            return None
        self.state = PathState.RELAY
        self.retrying = False
        self.n_fallbacks += 1
        self.retry_at_ms = now_ms + min(RETRY_CAP_MS, RETRY_BASE_MS * 2.0 ** min(self.n_fallbacks - 1, 30))
        self.why = why
        n = len(self.queue)
        if n:
            self.sent -= self.queued_bytes
            self.direct_sent = min(self.direct_sent, self.sent)
        self._clear()
        return n

    def retry_due(self, now_ms: float) -> bool:
        """Whether a path on the relay may try its channel again now."""
        return self.state is PathState.RELAY and now_ms >= self.retry_at_ms

    def retry(self, *, now_ms: float) -> None:
        """Connect again (from the relay): the connect bound counts from ``now_ms``; frames keep
        going through the relay until :meth:`opened` (:attr:`retrying`)."""
        if self.state is not PathState.RELAY:
            return
        self.state = PathState.CONNECTING
        self.retrying = True
        self.created_ms = now_ms

    def expired(self, *, now_ms: float, connect_timeout_ms: float, idle_timeout_ms: float | None) -> str | None:
        """Why the path must fall back now (a bound passed), or ``None``. ``idle_timeout_ms``
        ``None``: no idle bound (a stalled receiver passes ``None``: it reads nothing)."""
        if self.state is PathState.CONNECTING and now_ms - self.created_ms > connect_timeout_ms:
            return f"channel not open within {connect_timeout_ms / 1000.0:g} s"
        if (self.state is PathState.DIRECT and idle_timeout_ms
                and now_ms - self.last_rx_ms > idle_timeout_ms):
            return f"no bytes from the peer for {idle_timeout_ms / 1000.0:g} s"
        return None

    def _clear(self) -> None:
        self.queue.clear()
        self.n_urgent = 0
        self.queued_bytes = 0
