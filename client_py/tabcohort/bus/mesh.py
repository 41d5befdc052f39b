"""The mesh bus: a channel of its own per pair of ranks (a WebRTC data channel, or a direct TCP
connection between native ranks), negotiated through the server; a pair whose channel does not
come up within ``connect_timeout_s`` (or fails, or goes idle) uses the server relay for that
pair instead (docs/INTERFACES.md, "Bus").

The connector says what the channels are: ``path_kind`` (:class:`~tabcohort.bus.path.PathKind`)
and ``offer_kind``, the ``signal`` kind that starts a channel (``offer``: an SDP offer, answered;
``direct``: an address and key to dial, :mod:`tabcohort.bus.direct`). With
``relay_while_connecting`` (the direct TCP bus) a pair's frames go through the relay until its
channel is open, so nothing waits on the connect bound, and ``relay_peers`` names every peer
not on its own channel.

Composed of a :class:`~tabcohort.bus.star.StarBus` (the rank's socket to the server: id, peers,
controls, signalling, and the relay for pairs without a channel), a *connector* that makes the
channels (:class:`tabcohort.bus.aio.AiortcConnector` natively, :class:`tabcohort.bus.page.PageConnector`
in a tab) and one :class:`~tabcohort.bus.path.Path` per peer (state, queue, counters).

Signalling (JSON controls on the rank socket, forwarded by the server by recipient id within
the room, ``from`` bound to the link): ``{"type": "signal", "to": id, "kind": "offer"|"answer",
"sdp": ...}``, ``{"type": "signal", "to": id, "kind": "candidate", "candidate": {candidate,
sdpMid, sdpMLineIndex}}``, ``{"kind": "bye"}`` (the sender gave up on the pair's channel) and
``{"kind": "backlog", "bytes": n}`` (bytes of the recipient's this rank holds unconsumed: a
page cannot pause a data channel). The lower id offers. ``{"type": "relay_peers", "ids": [...]}``
tells the server which peers this rank reaches through the relay: in a mesh room a broadcast
chunk is relayed only to those.

Per path: a send queue drained into the channel while its ``bufferedAmount`` is below
``channel_high_water_bytes`` and refilled on ``bufferedamountlow``. ``pressure()`` is the max
over paths of (queued + buffered + the peer's backlog) / ``high_water_bytes``, and the relay's
pressure. ``bytes()`` counts chunk bytes per peer over whichever route carried them;
:meth:`MeshBus.transport_bytes` splits them (``rtc`` / ``relay``), so a silent fallback is
visible. Chunks are cut at the smallest negotiated max message size of the channels they go on
(the remote's ``a=max-message-size``, none -> 64 KiB; aiortc and Chromium advertise 256 KiB).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from ..errors import ConfigError, RemoteProtocolError
from ..wire import DATA_CHANNEL_MAX_MESSAGE_BYTES, FrameReader, FrameWriter, WireLimits, parse_route
from ..wire.codecs import DEFAULT_INT8_BLOCK
from .base import LinkBytes, check_bound_ms, delegated, merge_counts
from .path import CHANNEL_CLOSED, CLOSED_BY_PEER, RETRY_BASE_MS, Path, PathKind, PathState
from .room import DEFAULT_HIGH_WATER_BYTES, DEFAULT_MAX_QUEUE_BYTES
from .star import Channel, Connector, StarBus

log = logging.getLogger("tabcohort.bus.mesh")

DEFAULT_CONNECT_TIMEOUT_S = 5.0
#: how often the connect and idle bounds are checked, seconds
SUPERVISE_PERIOD_S = 0.25


#: a peer's offers are taken at most once per this many ms (PROTOCOL.md "Direct TCP path":
#: half the first retry delay, so an honest re-offer, at least RETRY_BASE_MS after the last
#: one, is never refused, whatever either side's connect bound)
OFFER_MIN_INTERVAL_MS = RETRY_BASE_MS / 2

class MeshBus:
    """One rank's bus over a WebRTC mesh (the bus contract; :class:`RoomBus
    <tabcohort.bus.base.RoomBus>`).

    Args:
        relay: the star bus to the server (not yet connected); this bus takes its controls.
        connector: makes the data channels.
        precision, int8_block, use_numpy, limits: the writer and the reader of every path.
        connect_timeout_s: a pair whose channel is not open after this long uses the relay.
        idle_timeout_s: an open channel with no bytes from the peer for this long moves to
            the relay (``None`` = off).
        high_water_bytes: queued + buffered bytes per path at which ``pressure()`` reaches 1.
        channel_high_water_bytes: flow control on each channel's ``bufferedAmount``.
        max_queue_bytes: per-path send queue bound (beyond it: ``send_overflow``).
        on_control: called with every server control (not ``signal``), ``failed``, and
            ``unreachable`` (the relay's link closed) naming the peers without a direct path.
        on_fallback: called with ``(peer, state it left, why)`` when a path moves to the relay.
        relay_while_connecting: a pair's frames take the relay until its channel is open
            (else they wait in the path's queue).
        relay_max_message_bytes: the chunk size of frames that go through the relay.
        backlog_max_pressure: the most a peer's ``backlog`` claim adds to ``pressure()``, in
            high-water marks. The default 1 is the protocol's (docs/PROTOCOL.md, the ``signal``
            control: a claim alone never paces this rank); only a test battery whose stalled
            page must pace its sender sets it higher, as the server's own knob
            (``ServerLimits.backlog_max_pressure``).
        clock_ms: the clock of every bound (ms); ``None``: the running event loop's.

    Raises:
        ConfigError: a bad precision or bound.
    """

    transport = "rtc-mesh"

    def __init__(self, relay: StarBus, connector: Connector, *, precision: str = "f32",
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S, idle_timeout_s: float | None = 10.0,
                 high_water_bytes: int = DEFAULT_HIGH_WATER_BYTES, channel_high_water_bytes: int = 1 << 20,
                 max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES, int8_block: int = DEFAULT_INT8_BLOCK,
                 use_numpy: bool | None = None, limits: WireLimits | None = None,
                 on_control: Callable[[dict], None] | None = None,
                 on_fallback: Callable[[int, PathState, str], None] | None = None,
                 relay_while_connecting: bool = False,
                 relay_max_message_bytes: int = DATA_CHANNEL_MAX_MESSAGE_BYTES,
                 backlog_max_pressure: float = 1.0,
                 clock_ms: Callable[[], float] | None = None) -> None:
        if not isinstance(high_water_bytes, int) or high_water_bytes < 1:
            raise ConfigError("high_water_bytes", high_water_bytes, "must be a positive int")
        if not (isinstance(backlog_max_pressure, (int, float)) and not isinstance(backlog_max_pressure, bool)
                and 0 <= backlog_max_pressure < float("inf")):
            raise ConfigError("backlog_max_pressure", backlog_max_pressure, "must be a finite number >= 0")
        if not (isinstance(connect_timeout_s, (int, float)) and connect_timeout_s > 0):
            raise ConfigError("connect_timeout_s", connect_timeout_s, "must be a positive number of seconds")
        FrameWriter(0, precision=precision, int8_block=int8_block)
        self.relay = relay
        relay.on_control = self._on_control
        relay.relay_sink = self._on_relay_chunk
        relay.relay_conflated = self._on_relay_conflated
        self.connector = connector
        self.path_kind: PathKind = getattr(connector, "path_kind", PathKind.RTC)
        self.offer_kind: str = getattr(connector, "offer_kind", "offer")
        self.transport = "tcp-mesh" if self.path_kind is PathKind.TCP else "rtc-mesh"
        self.relay_while_connecting = relay_while_connecting
        self.relay_max_message_bytes = relay_max_message_bytes
        self.precision = precision
        self.int8_block = int8_block
        self.use_numpy = use_numpy
        self.connect_timeout_s = float(connect_timeout_s)
        self.idle_timeout_s = idle_timeout_s
        self.high_water_bytes = high_water_bytes
        self.backlog_cap_bytes = int(backlog_max_pressure * high_water_bytes)
        self.channel_high_water_bytes = channel_high_water_bytes
        self.max_queue_bytes = max_queue_bytes
        self.on_control = on_control
        self.on_fallback = on_fallback
        self.on_message: Callable[[dict], None] | None = None
        self.writer: FrameWriter | None = None
        self.reader = FrameReader(limits, use_numpy=use_numpy)
        self.closed = False
        self.stalled = False
        #: peer id -> its path and its current channel (``None``: none, or on the relay)
        self.path_of: dict[int, Path] = {}
        #: bytes (all, and on the pairs' own channels) of paths dropped since: the totals only grow
        self._gone_bytes, self._gone_direct_bytes = 0, 0
        self.channel_of: dict[int, Channel | None] = {}
        self.fallbacks: list[tuple[int, str]] = []   # (peer, why), for logs and tests
        self._offer_ms: dict[int, float] = {}        # peer -> when its last offer was taken
        self._drops: dict[str, int] = {}
        # supervise ticks, and those more than 1 s after the previous one (a blocked loop)
        self.n_supervise_ticks = self.n_late_ticks = 0
        self._clock_ms = clock_ms
        self._relay_declared: set[int] | None = set()
        self._held: list[tuple[int, bytes]] = []
        self._supervisor: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ what the room says
    # what the room's socket knows (read-only here)
    id = delegated("relay", "id")
    secret = delegated("relay", "secret")
    connected = delegated("relay", "connected")
    failed = delegated("relay", "failed")
    stopped_reason = delegated("relay", "stopped_reason")
    n_reconnects = delegated("relay", "n_reconnects")
    may_lead = delegated("relay", "may_lead")
    lead_roles = delegated("relay", "lead_roles")
    n_moves = delegated("relay", "n_moves")
    server_base = delegated("relay", "server_base")

    @property
    def peers(self) -> set[int]:
        return set(self.path_of)

    @property
    def uplink_bytes(self) -> int:
        """Bytes sent on the socket and on every data channel."""
        return self.relay.uplink_bytes + sum(p.direct_sent for p in self.path_of.values())

    @property
    def downlink_bytes(self) -> int:
        return self.relay.downlink_bytes + sum(p.direct_received for p in self.path_of.values())

    @property
    def reach_bound_ms(self) -> float:
        """How long a new pair's frames may wait before they reach the peer at all: a pair's
        channel may take up to the connect bound to open (its frames wait in the path's queue),
        then the pair takes the relay; 0 with ``relay_while_connecting``. A joining rank waits
        this much longer for a connected rank that may lead (PROTOCOL.md "Joining")."""
        return 0.0 if self.relay_while_connecting else self.connect_timeout_s * 1000.0

    def now_ms(self) -> float:
        return self._clock_ms() if self._clock_ms is not None else self._loop.time() * 1000.0

    # ------------------------------------------------------------------ lifecycle
    async def connect(self, timeout_s: float = 10.0) -> "MeshBus":
        """Join the room's socket (id, peers), then open a channel to every peer.

        Raises:
            LinkFailed: the server refused or did not answer.
        """
        self.connector.check()
        self._loop = asyncio.get_running_loop()   # (peers and offers may arrive with the welcome)
        await self.relay.connect(timeout_s)
        self.writer = FrameWriter(self.id, precision=self.precision, int8_block=self.int8_block,
                                  use_numpy=self.use_numpy)
        for p in sorted(self.relay.peers):
            self._ensure_path(p)
        if self.relay_while_connecting:
            self._declare_relay()
        self._supervisor = self._loop.create_task(self._supervise())
        return self

    def close(self) -> None:
        """Stop delivery both ways (idempotent); :meth:`aclose` waits for the channels and socket."""
        if self.closed:
            return
        self.closed = True
        self.on_message = None
        if self._supervisor is not None:
            self._supervisor.cancel()
        for peer in list(self.channel_of):
            self._close_channel(peer)
        self.relay.close()

    async def aclose(self) -> None:
        self.close()
        await self.relay.aclose()
        await self.connector.aclose()

    def send_control(self, obj: dict) -> None:
        self.relay.send_control(obj)

    # ------------------------------------------------------------------ the bus contract
    def post(self, msg: dict, *, writer: FrameWriter | None = None) -> None:
        """Encode ``msg`` once and put it on each target's path (all peers, or ``msg["to"]``).

        Args:
            writer: encode with this writer instead of the bus's (its sender must be this
                bus's id; a process group sends at a per-call precision).

        Raises:
            LocalProtocolError: the message cannot be encoded.
        """
        if self.closed or self.writer is None:
            return
        w = writer or self.writer
        to = msg.get("to")
        if to is not None:
            p = self.path_of.get(to)
            if p is None:
                w.write(msg)   # still validate and encode, as the other buses do
                if to != self.id:
                    self._count("no_route")
                return
            targets = [p]
        else:
            targets = list(self.path_of.values())
        relayed = [p for p in targets if self._relayed(p)]
        cut = min((p.max_message_bytes for p in targets if not self._relayed(p)),
                  default=self.relay_max_message_bytes)
        if relayed:
            cut = min(cut, self.relay_max_message_bytes, self.relay.server_max_message_bytes or cut)
        w.max_message_bytes = cut
        chunks = w.write(msg)
        size = sum(map(len, chunks))
        for p in targets:
            if self._relayed(p):
                continue
            elif not p.enqueue(chunks, size, max_queue_bytes=self.max_queue_bytes):
                self._count("send_overflow")
            elif p.state is PathState.DIRECT:
                self._drain(p.peer)
        if relayed and self.relay.send_raw(chunks):
            for p in relayed:
                p.sent += size

    def _relayed(self, p: Path) -> bool:
        """Whether a frame for ``p`` goes through the relay now."""
        return p.state is PathState.RELAY or (p.state is PathState.CONNECTING
                                              and (self.relay_while_connecting or p.retrying))

    def bytes(self) -> dict[int, LinkBytes]:
        return {k: LinkBytes(p.sent, p.received) for k, p in sorted(self.path_of.items()) if p.sent or p.received}

    def total_bytes(self) -> int:
        # (with the paths dropped: a peer that left took its bytes out of the total, and the
        # leader's report showed a negative wire_bytes_per_s: a new-user trial)
        return self._gone_bytes + sum(p.sent + p.received for p in self.path_of.values())

    def transport_bytes(self) -> dict[str, int]:
        """Bytes (sent + received) carried by the pairs' own channels (keyed by their kind:
        ``rtc`` or ``tcp``) and by the relay."""
        own = self._gone_direct_bytes + sum(p.direct_sent + p.direct_received for p in self.path_of.values())
        return {self.path_kind.value: own, "relay": self.total_bytes() - own}

    def pair_bytes(self) -> dict[int, dict[str, int]]:
        """Per peer: bytes (sent + received) on its own channel (keyed by kind) and through the relay."""
        k = self.path_kind.value
        return {peer: {k: p.direct_sent + p.direct_received,
                       "relay": p.sent + p.received - p.direct_sent - p.direct_received}
                for peer, p in sorted(self.path_of.items())}

    def supervise_ticks(self) -> dict[str, int]:
        """The supervision ticks and those late (the loop blocked for > 1 s)."""
        return {"ticks": self.n_supervise_ticks, "late": self.n_late_ticks}

    def paths(self) -> dict[int, str]:
        """Each peer's path: its channel's kind (``rtc``, ``tcp``), ``relay`` or ``connecting``
        (not yet up, within the bound)."""
        return {k: p.label for k, p in sorted(self.path_of.items())}

    def path(self, peer: int) -> Path | None:
        """The path to ``peer`` (read it; the bus changes it)."""
        return self.path_of.get(peer)

    def channel_buffered(self, peer: int) -> int:
        ch = self.channel_of.get(peer)
        return ch.buffered_bytes() if ch is not None else 0

    def queued_bytes(self) -> int:
        return self.relay.queued_bytes() + sum(p.queued_bytes for p in self.path_of.values())

    def pressure(self) -> float:
        worst = max((p.buffered(self.channel_buffered(k)) for k, p in self.path_of.items()), default=0)
        return max(worst / self.high_water_bytes, self.relay.pressure())

    def flushed(self) -> bool:
        """Everything posted is on the wire and, on channels, acknowledged by the peer."""
        for k, p in self.path_of.items():
            ch = self.channel_of.get(k)
            if p.buffered(self.channel_buffered(k)) or (ch is not None and not ch.idle()):
                return False
        return not self.relay.queued_bytes()

    def quantize(self, params: Any) -> Any:
        """As the star bus's (the same precision, before and after :meth:`connect`)."""
        return self.writer.quantize(params) if self.writer is not None else self.relay.quantize(params)

    def set_silence_bound_ms(self, bound_ms: float) -> None:
        """An open direct path with no bytes from its peer for ``bound_ms`` moves to the relay
        (``RoomBus``; docs/PROTOCOL.md "Direct TCP path", "Silence")."""
        self.idle_timeout_s = check_bound_ms(bound_ms) / 1000.0

    def set_precision(self, precision: str) -> None:
        """As :meth:`StarBus.set_precision <tabcohort.bus.star.StarBus.set_precision>` (the relay's too)."""
        w = FrameWriter(self.id, precision=precision, int8_block=self.int8_block, use_numpy=self.use_numpy)
        self.precision = precision
        if self.writer is not None:
            self.writer = w
        self.relay.set_precision(precision)

    def drops(self) -> dict[str, int]:
        return merge_counts(self.reader.drops, self._drops, self.relay.drops(), getattr(self.connector, "drops", {}))

    def held_bytes(self) -> int:
        """Chunk bytes taken off the wire while stalled and held, on every path (tests)."""
        return sum(len(c) for _, c in self._held) + self.relay.held_bytes()

    def stall(self, stalled: bool) -> None:
        """Tests: stop (True) / resume (False) taking data off every path (held, not lost; a
        connector that cannot pause its channels reports the held bytes as ``backlog``)."""
        self.stalled = stalled
        if self.connector.can_pause:
            for k, ch in self.channel_of.items():
                if ch is not None and self.path_of[k].state is PathState.DIRECT:
                    ch.pause(stalled)
        if not stalled:
            held, self._held = self._held, []
            for peer, chunk in held:
                p = self.path_of.get(peer)
                if p is not None:
                    self._deliver(p, chunk)
            for p in self.path_of.values():
                p.release()
                self._report_backlog(p)
        self.relay.stall(stalled)

    def _count(self, reason: str, n: int = 1) -> None:
        self._drops[reason] = self._drops.get(reason, 0) + n

    # ------------------------------------------------------------------ paths
    def _ensure_path(self, peer: int, *, declare: bool = True) -> Path:
        p = self.path_of.get(peer)
        if p is None:
            p = self.path_of[peer] = Path(peer, now_ms=self.now_ms(), kind=self.path_kind)
            self.channel_of[peer] = None
            if self.id < peer:
                self.channel_of[peer] = self.connector.open(peer, self)
            if declare:
                self._declare_relay()
        return p

    def _close_channel(self, peer: int) -> None:
        ch = self.channel_of.get(peer)
        self.channel_of[peer] = None
        if ch is not None:
            ch.close()

    def _drop_path(self, peer: int, *, declare: bool = True) -> None:
        p = self.path_of.pop(peer, None)
        self._offer_ms.pop(peer, None)
        if p is not None:
            self._gone_bytes += p.sent + p.received
            self._gone_direct_bytes += p.direct_sent + p.direct_received
            self._close_channel(peer)
            del self.channel_of[peer]
            if declare:
                self._declare_relay()

    def _drain(self, peer: int) -> None:
        ch, p = self.channel_of.get(peer), self.path_of.get(peer)
        if ch is None or p is None:
            return
        p.pump(ch, self.channel_high_water_bytes)

    def _fallback(self, p: Path, why: str, *, now_ms: float | None = None) -> None:
        """Move one pair to the server relay; the lower id tries its channel again after the
        path's backoff (:meth:`supervise`; bus/path.py)."""
        if self.closed:
            return
        was = p.state
        now_ms = self.now_ms() if now_ms is None else now_ms
        n = p.fallback(why, now_ms=now_ms)
        if n is None:
            return
        if n:
            self._count("link_down", n)
        self.fallbacks.append((p.peer, why))
        again = (f" (tries its channel again in {(p.retry_at_ms - now_ms) / 1000.0:.0f} s)"
                 if self.id < p.peer else "")
        # a warning when a path went down or a connection failed; a path whose peer never answered
        # within the connect bound (a tab takes no TCP path: README "Direct paths") is the normal
        # case of a mixed room, and a connection the peer closed cleanly is a peer leaving (every
        # rank at a room's stop) or gone (its kernel closes a killed process's sockets too, and the
        # room then reports it left): both logged without alarm, as is anything once the server
        # stopped the room (a peer that left first: a broken pipe); a reset or an error still warns
        quiet = (was is PathState.CONNECTING and why.startswith("channel not open within")) or \
            why in (CLOSED_BY_PEER, CHANNEL_CLOSED) or self.stopped_reason is not None
        (log.info if quiet else log.warning)("rank %08x: link to %08x uses the relay: %s%s",
                                             self.id, p.peer, why, again)
        self.relay.send_control({"type": "signal", "to": p.peer, "kind": "bye"})
        self._close_channel(p.peer)
        self._declare_relay()
        if self.on_fallback is not None:
            self.on_fallback(p.peer, was, why)
        if was is PathState.DIRECT and not self.relay.connected and self.on_control is not None:
            # the pair's last path closed while the relay's link is down: out of reach until heard
            # from again, as when the relay's link closes (docs/PROTOCOL.md "Membership and majority")
            self.on_control({"type": "unreachable", "ids": [p.peer]})

    def _declare_relay(self) -> None:
        if self.writer is None:
            return   # (connect declares once every first path is made)
        ids = {k for k, p in self.path_of.items() if self._relayed(p)}
        if ids != self._relay_declared:
            self._relay_declared = ids
            self.relay.send_control({"type": "relay_peers", "ids": sorted(ids)})

    async def _supervise(self) -> None:
        """Once per :data:`SUPERVISE_PERIOD_S`: :meth:`supervise`."""
        last = self.now_ms()
        while not self.closed:
            await asyncio.sleep(SUPERVISE_PERIOD_S)
            now = self.now_ms()
            self.supervise(now, late=now - last > 4 * SUPERVISE_PERIOD_S * 1000.0)
            last = now

    def supervise(self, now_ms: float, *, late: bool = False) -> None:
        """One supervise tick: every path's connect and idle bounds (bus/path.py), and the
        lower id's retry of a pair on the relay (docs/PROTOCOL.md "Direct TCP path", Retry).

        ``late``: the tick came more than 1 s after the previous one, so the loop was blocked (a
        long computation, a loaded host) and has not read what the peers sent meanwhile: no idle
        verdict then. A retry still starts: it is this rank's own decision and reads nothing the
        peer sent, and a busy tab's every tick may be late.
        """
        self.n_supervise_ticks += 1
        self.n_late_ticks += late
        idle_ms = (None if self.stalled or not self.idle_timeout_s or late
                   else self.idle_timeout_s * 1000.0)
        for p in list(self.path_of.values()):
            why = p.expired(now_ms=now_ms, connect_timeout_ms=self.connect_timeout_s * 1000.0, idle_timeout_ms=idle_ms)
            if why is not None:
                self._fallback(p, why, now_ms=now_ms)
            elif self.id < p.peer and p.retry_due(now_ms) and self.relay.connected:
                self._retry(p, now_ms=now_ms)

    def _retry(self, p: Path, *, now_ms: float) -> None:
        """The lower id offers the pair's channel again; frames keep using the relay meanwhile."""
        p.retry(now_ms=now_ms)
        log.info("rank %08x: trying the %s channel to %08x again (fallback %d)",
                 self.id, p.kind.value, p.peer, p.n_fallbacks)
        self._close_channel(p.peer)
        self.channel_of[p.peer] = self.connector.open(p.peer, self)

    def _peer_of(self, ch: Any) -> Path | None:
        """The path whose current channel is ``ch`` (a replaced channel's events are stale)."""
        peer = getattr(ch, "peer", None)
        if self.closed or self.channel_of.get(peer) is not ch:
            return None
        return self.path_of.get(peer)

    # ------------------------------------------------------------------ the channels' events
    def channel_open(self, ch: Any, max_message_bytes: int) -> None:
        p = self._peer_of(ch)
        if p is None or p.state is not PathState.CONNECTING:
            return
        n = p.opened(max_message_bytes, now_ms=self.now_ms())
        if n:
            self._count("link_down", n)
        if self.stalled and self.connector.can_pause:
            ch.pause(True)
        log.info("rank %08x: %s channel to %08x open after %.2f s (max message %d)",
                 self.id, p.kind.value, p.peer, p.up_after_ms / 1000.0, p.max_message_bytes)
        self._declare_relay()
        self._drain(p.peer)

    def channel_chunk(self, ch: Any, chunk: bytes, owned: bool = False) -> None:
        p = self._peer_of(ch)
        if p is None:
            return
        p.last_rx_ms = self.now_ms()
        try:
            sender = parse_route(chunk).sender
        except RemoteProtocolError:
            sender = p.peer          # (malformed: the wire reader drops and counts it)
        if sender != p.peer:
            # docs/PROTOCOL.md "Direct TCP path": a chunk on a peer's own channel is that peer's,
            # as the relay binds a chunk's sender to its link; one naming another rank (a forged
            # round "from the leader", a beat "from" a rank that stopped) is dropped
            p.received_chunk(len(chunk), direct=True, now_ms=self.now_ms())
            self._count("spoofed_sender")
            return
        if self.stalled:
            self._held.append((p.peer, chunk))
            if not self.connector.can_pause:   # the page cannot pause the channel: tell the sender
                p.hold(len(chunk))
                self._report_backlog(p)
            return
        self._deliver(p, chunk, owned=owned)

    def channel_progress(self, ch: Any) -> None:
        p = self._peer_of(ch)
        if p is not None:
            p.last_rx_ms = self.now_ms()

    def channel_conflated(self, ch: Any, sender: Any, frames: int, chunks: int, n_bytes: int) -> None:
        """Superseded rounds the page dropped unread from this channel (PROTOCOL.md, "Follower:
        receiving messages"): received bytes, and ``round_superseded`` per frame."""
        p = self._peer_of(ch)
        if p is not None:
            p.received_chunk(n_bytes, direct=True, now_ms=self.now_ms())
            self._count("round_superseded", frames)

    def channel_low(self, ch: Any) -> None:
        p = self._peer_of(ch)
        if p is not None:
            self._drain(p.peer)

    def channel_down(self, ch: Any, why: str) -> None:
        p = self._peer_of(ch)
        if p is not None and p.state is not PathState.RELAY:
            self._fallback(p, why)

    def channel_signal(self, ch: Any, signal: dict) -> None:
        p = self._peer_of(ch)
        if p is not None and signal.get("kind") in ("offer", "answer", "candidate", "direct"):
            self.relay.send_control({**signal, "type": "signal", "to": p.peer})

    def _report_backlog(self, p: Path) -> None:
        n = p.backlog_to_report(self.high_water_bytes)
        if n is not None:
            self.relay.send_control({"type": "signal", "to": p.peer, "kind": "backlog", "bytes": n})

    # ------------------------------------------------------------------ inbound
    def _on_relay_chunk(self, chunk: bytes) -> None:
        try:
            sender = parse_route(chunk).sender
        except Exception:
            sender = 0
        p = self.path_of.get(sender)
        if p is None:
            self._count("unknown_sender")
            return
        self._deliver(p, chunk, direct=False)

    def _on_relay_conflated(self, sender: int, n_bytes: int) -> None:
        p = self.path_of.get(sender)
        if p is not None:
            p.received_chunk(n_bytes, direct=False, now_ms=self.now_ms())

    def _deliver(self, p: Path, chunk: bytes, *, direct: bool = True, owned: bool = False) -> None:
        if self.closed:
            return
        p.received_chunk(len(chunk), direct=direct, now_ms=self.now_ms())
        for m in self.reader.feed(chunk, now_ms=self.now_ms(), owned=owned):
            cb = self.on_message
            if cb is not None and not self.closed:
                cb(m)

    def _on_control(self, obj: dict) -> None:
        if self.closed:
            return
        t = obj.get("type")
        if t == "peer":
            k = obj.get("id")
            if isinstance(k, int) and k != self.id:
                if obj.get("up"):
                    p = self.path_of.get(k)
                    if p is not None and p.state is PathState.RELAY:
                        self._drop_path(k)   # a reconnected peer gets a fresh try
                    self._ensure_path(k)
                else:
                    self._drop_path(k)
        elif t == "signal":
            self._on_signal(obj)
            return
        elif t == "unreachable":
            # the relay's link closed: a peer on a direct path is still in reach
            direct = {k for k, p in self.path_of.items() if p.state is PathState.DIRECT}
            ids = [k for k in obj.get("ids", ()) if k not in direct]
            if not ids:
                return
            obj = {"type": "unreachable", "ids": ids}
        elif t in ("welcome", "roll_call") and self.writer is not None:
            # a resumed socket (maybe at the node that took the room over): its roll call is the
            # peer table now (docs/PROTOCOL.md "Membership and majority"). A rank that joined
            # while this one was away gets no ``peer`` control of its own: without a path it is
            # neither sent to nor declared, and its chunks are dropped (``unknown_sender``); one
            # not listed left meanwhile, unless the roll call is partial (a restarted server's:
            # the others may still come back, and a direct path to one may be up all along).
            # (``relay.peers`` already holds the list.)
            listed = set(self.relay.peers)
            if t == "welcome":
                self._offer_ms.clear()   # (a resumed rank: the lower ids offer again at once)
            for k in [k for k in self.path_of if k not in listed and obj.get("partial") is not True]:
                self._drop_path(k, declare=False)
            for k in sorted(listed - set(self.path_of)):
                self._ensure_path(k, declare=False)
            # the server forgot what we relay through it
            # (None: declared again even when empty; a server that never heard it relays to all)
            self._relay_declared = None
            self._declare_relay()
        if self.on_control is not None:
            self.on_control(obj)

    def _on_signal(self, obj: dict) -> None:
        frm, kind = obj.get("from"), obj.get("kind")
        if not isinstance(frm, int) or isinstance(frm, bool) or frm == self.id:
            return
        p = self._ensure_path(frm)
        if kind == "backlog":
            # a peer's claim counts at most one high-water mark (backlog_max_pressure 1): alone
            # it never lifts this rank's pressure over 1, so it paces nothing (a rank of any role
            # could send a huge one and stall the room; the server caps its own backlog control
            # the same way)
            if not p.set_remote_backlog(obj.get("bytes"), self.backlog_cap_bytes):
                self._count("bad_signal")
            return
        if kind == self.offer_kind and frm < self.id:
            # PROTOCOL.md "Direct TCP path": an offer replaces the channel it finds, so a peer's
            # offers are taken at most once per OFFER_MIN_INTERVAL_MS (an honest lower id offers
            # again only after a fallback and its backoff, RETRY_BASE_MS or more later); a flood
            # of offers opened a connection each
            now = self.now_ms()
            last = self._offer_ms.get(frm)
            if last is not None and 0 <= now - last < OFFER_MIN_INTERVAL_MS:
                self._count("offer_too_soon")
                return
            self._offer_ms[frm] = now
        if p.state is PathState.RELAY:
            if kind != self.offer_kind or frm > self.id:
                return
            p.retry(now_ms=self.now_ms())   # the lower id tries the channel again
        ch = self.channel_of.get(frm)
        if kind == "direct" and self.offer_kind == "direct" and frm < self.id:
            self._close_channel(frm)   # (the connector validates the announced address and key)
            self.channel_of[frm] = self.connector.open(frm, self, offer=obj)
        elif kind == "offer" and self.offer_kind == "offer" and isinstance(obj.get("sdp"), str) and frm < self.id:
            self._close_channel(frm)
            self.channel_of[frm] = self.connector.open(frm, self, offer_sdp=obj["sdp"])
        elif kind in ("answer", "candidate") and ch is not None:
            ch.signal({k: obj[k] for k in ("kind", "sdp", "candidate") if k in obj})
        elif kind == "answer" and isinstance(obj.get("sdp"), str):
            pass   # an answer to an offer this rank replaced
        elif kind == "bye":
            self._fallback(p, "peer gave up on the channel")
        else:
            self._count("bad_signal")
