"""The star bus: every rank has one link, to the server, which relays by routing header.

Composed, not subclassed (docs/INTERFACES.md, "Bus"): a :class:`~tabcohort.bus.room.RoomClient`
(the relay protocol, peer table, byte counts, queue bound, reconnect deadlines), a *socket
adapter* to the server (:class:`tabcohort.bus.aio.AiohttpSocket` natively,
:class:`tabcohort.bus.page.PageSocket` in a tab) and, for ``--link rtc``, a *connector*
(:class:`tabcohort.bus.aio.AiortcConnector`, :class:`tabcohort.bus.page.PageConnector`) whose
one data channel to the server carries the chunks while it is open, with a
:class:`~tabcohort.bus.path.Path` for its queue and counters.

Wire (the socket, two message kinds; docs/INTERFACES.md, "Bus"): binary messages are chunks exactly
as :class:`~tabcohort.wire.FrameWriter` writes them; text messages are JSON controls
(rank -> server: ``register``, ``report``, ``backlog``, ``signal``, ``relay_peers``; server ->
rank: ``welcome``, ``peer``, ``pressure``, ``stop``, ``signal``).

Byte accounting (the bus contract's ``bytes()``): per peer id, the chunk bytes sent to it
through the relay (a broadcast counts once per peer this bus knows) and received from it.
Controls are not in ``bytes()``; :attr:`StarBus.uplink_bytes` / :attr:`StarBus.downlink_bytes`
are the raw totals, controls included. ``pressure()`` is ``max(bytes not yet on the wire /
high_water_bytes, relay pressure)``.

A socket adapter has ``can_pause``: a native socket stops reading while the bus is stalled
(the relay sees its writes back up); the page cannot pause its socket, so the bus holds what
arrives and reports it to the server as ``backlog``, which counts in the relay's pressure.
The data channel to the server, when there is one, follows the same rule.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable, Protocol

from ..errors import ConfigError, RemoteProtocolError
from ..wire import DEFAULT_MAX_MESSAGE_BYTES, FrameReader, FrameWriter, WireLimits, parse_route
from ..wire.codecs import DEFAULT_INT8_BLOCK
from .base import LinkBytes, check_bound_ms, delegated, merge_counts
from .path import Path, PathState
from .room import CLOSE_MOVED, DEFAULT_HIGH_WATER_BYTES, DEFAULT_MAX_QUEUE_BYTES, LinkFailed, RoomClient, http_base

log = logging.getLogger("tabcohort.bus.star")

#: a reconnect attempt that has no ``welcome`` after this long counts as failed
ATTEMPT_TIMEOUT_S = 10.0


class SocketListener(Protocol):
    """What a socket adapter calls (the bus)."""

    def on_open(self) -> None: ...
    def on_text(self, text: str) -> None: ...
    def on_chunk(self, chunk: bytes) -> None: ...
    def on_conflated(self, sender: Any, frames: int, chunks: int, n_bytes: int) -> None: ...
    def on_closed(self, code: int | None, reason: str) -> None: ...


class Socket(Protocol):
    """A transport adapter for the rank's socket to the server (one per bus).

    ``open`` starts connecting and reports through the listener (``on_open`` then ``on_text``
    / ``on_chunk``, and one ``on_closed``: ``code`` ``None`` for a network error). An adapter
    that drops superseded round frames before the bus sees them (the page worker's
    ``tcConflate``) says so with ``on_conflated`` (the sender, frames, chunks and bytes dropped:
    they were received). ``close``
    never calls the listener. ``queued_bytes`` is what was handed over and is not on the wire.
    """

    can_pause: bool

    def open(self, url: str, listener: SocketListener) -> None: ...
    def send_chunks(self, chunks: list[bytes]) -> None: ...
    def send_text(self, text: str) -> None: ...
    def queued_bytes(self) -> int: ...
    def discard(self) -> int: ...
    def pause(self, paused: bool) -> None: ...
    def close(self) -> None: ...
    async def aclose(self) -> None: ...


class ChannelListener(Protocol):
    """What a data channel calls (a star or a mesh bus); ``ch`` says which channel."""

    def channel_open(self, ch: Any, max_message_bytes: int) -> None: ...
    def channel_chunk(self, ch: Any, chunk: bytes, owned: bool = False) -> None:
        """One chunk off ``ch``. ``owned``: ``chunk`` is writable memory of its own that nothing
        else holds or reuses (a direct path's chunk buffer), so the wire reader may decode its
        vectors as views of it (:meth:`tabcohort.wire.FrameReader.feed`)."""
    def channel_progress(self, ch: Any) -> None:
        """Bytes of a chunk not yet whole arrived on ``ch`` (a direct path's long chunk): the
        peer is alive, as a whole chunk says (the path's idle bound)."""
    def channel_conflated(self, ch: Any, sender: Any, frames: int, chunks: int, n_bytes: int) -> None: ...
    def channel_low(self, ch: Any) -> None: ...
    def channel_down(self, ch: Any, why: str) -> None: ...
    def channel_signal(self, ch: Any, signal: dict) -> None: ...


class Channel(Protocol):
    """One data channel (ordered, reliable, binary) to one peer, made by a :class:`Connector`."""

    def buffered_bytes(self) -> int: ...
    def send(self, chunks: list[bytes]) -> bool:
        """Put ``chunks`` on the channel; False when it took none onto the wire now (closed,
        closing, or its send deferred to the event loop)."""
    def signal(self, signal: dict) -> None: ...
    def pause(self, paused: bool) -> None: ...
    def idle(self) -> bool: ...
    def close(self) -> None: ...


class Connector(Protocol):
    """Makes data channels: offers (``offer_sdp`` ``None``) or answers a remote offer."""

    can_pause: bool
    drops: dict[str, int]
    ice_servers: list[str]

    def check(self) -> None: ...
    def open(self, peer: int, listener: ChannelListener, *, offer_sdp: str | None = None) -> Channel: ...
    async def aclose(self) -> None: ...


class StarBus:
    """One rank's bus over the server's star relay (the bus contract; :class:`RoomBus
    <tabcohort.bus.base.RoomBus>`).

    Args:
        socket: the socket adapter to the server.
        url: ``ws(s)://host:port/api/rooms/{room}/ws``.
        connector: for a data channel to the server (``rtc-star``); ``None``: chunks on the socket.
        token, trainer_token, high_water_bytes, max_queue_bytes, reconnect_max_s: as for
            :class:`RoomClient`.
        precision, max_message_bytes, int8_block, use_numpy, limits: the writer and reader.
        connect_timeout_s: the bound on the channel to the server coming up (then the socket
            carries the chunks).
        channel_high_water_bytes: chunks wait in this bus while the channel buffers this much.
        on_control: called with every well-formed server control after the bus handled it,
            with ``{"type": "unreachable", "ids"}`` (every peer, sorted) when a linked socket
            closes, and with ``{"type": "failed", "reason", "rejoin"}`` when the bus gives up.

    Raises:
        ConfigError: a bad precision, size or bound.
    """

    def __init__(self, socket: Socket, url: str, *, connector: Connector | None = None,
                 token: str | None = None, trainer_token: str | None = None, precision: str = "f32",
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 high_water_bytes: int = DEFAULT_HIGH_WATER_BYTES, int8_block: int = DEFAULT_INT8_BLOCK,
                 limits: WireLimits | None = None, use_numpy: bool | None = None,
                 reconnect_max_s: float = 30.0, max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
                 connect_timeout_s: float = 5.0, channel_high_water_bytes: int = 1 << 20,
                 on_control: Callable[[dict], None] | None = None) -> None:
        FrameWriter(0, precision=precision, max_message_bytes=max_message_bytes, int8_block=int8_block)
        if not (isinstance(connect_timeout_s, (int, float)) and connect_timeout_s > 0):
            raise ConfigError("connect_timeout_s", connect_timeout_s, "must be a positive number of seconds")
        self.room = RoomClient(url, token=token, trainer_token=trainer_token, high_water_bytes=high_water_bytes,
                               max_queue_bytes=max_queue_bytes, reconnect_max_s=reconnect_max_s)
        self.socket = socket
        self.connector = connector
        self.transport = "rtc-star" if connector is not None else "ws-star"
        self.precision = precision
        self.max_message_bytes = max_message_bytes
        self.int8_block = int8_block
        self.use_numpy = use_numpy
        self.high_water_bytes = high_water_bytes
        self.connect_timeout_s = float(connect_timeout_s)
        self.channel_high_water_bytes = channel_high_water_bytes
        self.on_control = on_control
        self.on_message: Callable[[dict], None] | None = None
        #: when set (by the mesh bus), every inbound chunk goes here undecoded and uncounted
        self.relay_sink: Callable[[bytes], None] | None = None
        #: with ``relay_sink``: told ``(sender, bytes)`` of superseded rounds dropped unread
        self.relay_conflated: Callable[[int, int], None] | None = None
        self.writer: FrameWriter | None = None
        self.reader = FrameReader(limits, use_numpy=use_numpy)
        self.closed = False
        self.stalled = False
        #: the data channel to the server and its path (``rtc-star`` only)
        self.channel: Channel | None = None
        self.path: Path | None = None
        self.n_sent = 0           # messages handed over (chunks on either path + controls)
        self.n_received = 0       # messages taken off (chunks on either path + controls)
        self.uplink_bytes = 0
        self.downlink_bytes = 0
        self.ws_chunk_bytes_out = 0
        #: the largest message the server says it reads (its ``welcome``), once known
        self.server_max_message_bytes: int | None = None
        self.chunk_bytes_in = 0
        self._held: list[tuple[bytes, bool]] = []
        self._held_bytes = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._welcome: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reached = False     # the current socket opened (a redirect to a dead node did not)

    # ------------------------------------------------------------------ what the room says
    # what the room client knows (read-only here)
    id = delegated("room", "id")
    secret = delegated("room", "secret")
    peers = delegated("room", "peers")
    failed = delegated("room", "failed")
    stopped_reason = delegated("room", "stopped_reason")
    n_reconnects = delegated("room", "n_reconnects")
    relay_pressure = delegated("room", "relay_pressure")
    may_lead = delegated("room", "may_lead")
    lead_roles = delegated("room", "lead_roles")
    n_moves = delegated("room", "n_moves")
    url = delegated("room", "url")
    entry_url = delegated("room", "entry_url")

    @property
    def server_base(self) -> str:
        """``http(s)://host:port`` of the node this bus is linked to (it moves in a cluster)."""
        return http_base(self.room.url)

    @property
    def connected(self) -> bool:
        return self.room.connected and not self.closed

    def now_ms(self) -> float:
        return self._loop.time() * 1000.0

    # ------------------------------------------------------------------ lifecycle
    async def connect(self, timeout_s: float = 10.0) -> "StarBus":
        """Open the socket, register, learn ``id``; then (``rtc-star``) open the channel,
        bounded by ``connect_timeout_s`` (its failing is not fatal).

        Raises:
            LinkFailed: the server refused (bad token, room full) or did not answer in time.
        """
        if self.connector is not None:
            self.connector.check()
        self._loop = asyncio.get_running_loop()
        while True:
            try:
                await self._open(timeout_s)
                break
            except LinkFailed as e:
                at = None if self.closed else self.room.refused(e.code, now_ms=self.now_ms())
                if at is None:   # given up: release what the attempt opened (aiohttp's session)
                    await self.socket.aclose()
                    raise
                log.info("server admits registrations at a bounded rate (close %s); retry in %.2f s",
                         e.code, at / 1000.0 - self._loop.time())
                await asyncio.sleep(max(0.0, at / 1000.0 - self._loop.time()))
        self.writer = FrameWriter(self.id, precision=self.precision, max_message_bytes=self.max_message_bytes,
                                  int8_block=self.int8_block, use_numpy=self.use_numpy)
        if self.connector is not None:
            await self._open_channel()
        return self

    async def _open(self, timeout_s: float) -> None:
        self._welcome = self._loop.create_future()
        self._open_socket(self.room.new_attempt())
        try:
            await asyncio.wait_for(asyncio.shield(self._welcome), timeout_s)
        except asyncio.TimeoutError:
            self.socket.close()
            raise LinkFailed(f"cannot connect to {self.room.url}: no welcome within {timeout_s:g} s") from None
        finally:
            self._welcome = None

    async def _open_channel(self) -> None:
        self.path = Path(0, now_ms=self.now_ms())
        self.channel = self.connector.open(0, self)
        end = self._loop.time() + self.connect_timeout_s
        while self.path.state is PathState.CONNECTING and self._loop.time() < end:
            await asyncio.sleep(0.02)
        if self.path.state is PathState.CONNECTING:
            self._channel_lost(f"channel to the server not open within {self.connect_timeout_s:g} s")

    def close(self) -> None:
        """Stop delivery both ways (idempotent). :meth:`aclose` also waits for the teardown."""
        if self.closed:
            return
        self.closed = True
        self.on_message = None
        if self._timer is not None:
            self._timer.cancel()
        if self.channel is not None:
            self.channel.close()
        self.socket.close()

    async def aclose(self) -> None:
        self.close()
        await self.socket.aclose()
        if self.connector is not None:
            await self.connector.aclose()

    # ------------------------------------------------------------------ the bus contract
    def post(self, msg: dict) -> None:
        """Encode ``msg`` and send its chunks to the relay (all peers, or ``msg["to"]``).

        Raises:
            LocalProtocolError: the message cannot be encoded.
        """
        if self.closed or self.writer is None:
            return
        chunks = self.writer.write(msg)
        if msg.get("to") is None and self.room.connected and not self.room.peers:
            # a broadcast the relay has no one to deliver to (the server's roll call, kept by
            # its peer controls): a lone leader's every round went to the server, which over a
            # data channel cost it 6x its round rate (PROTOCOL.md, "Bus contract")
            return
        size = sum(map(len, chunks))
        if not self.room.admit(size, self.queued_bytes()):
            return
        self.room.count_sent(msg.get("to"), size)
        self._put(chunks, size)

    def send_raw(self, chunks: list[bytes]) -> bool:
        """Send already-encoded chunks to the relay as they are (no per-peer accounting).

        Returns:
            ``False`` when they were dropped (closed, disconnected or the queue bound).
        """
        size = sum(map(len, chunks))
        if self.closed or not self.room.admit(size, self.queued_bytes()):
            return False
        self._put(chunks, size)
        return True

    def _put(self, chunks: list[bytes], size: int) -> None:
        self.uplink_bytes += size
        self.n_sent += len(chunks)
        p = self.path
        if p is not None and p.state is PathState.DIRECT:
            p.enqueue(chunks, size, max_queue_bytes=self.room.max_queue_bytes)
            self._drain()
            return
        self.ws_chunk_bytes_out += size
        self.socket.send_chunks(chunks)

    def send_control(self, obj: dict) -> None:
        """Queue a JSON control (e.g. a state report) on the socket; dropped while disconnected."""
        if self.connected:
            self._send_text(json.dumps(obj, separators=(",", ":"), default=str))

    def _send_text(self, text: str) -> None:
        self.n_sent += 1
        self.uplink_bytes += len(text)
        self.socket.send_text(text)

    def bytes(self) -> dict[int, LinkBytes]:
        return self.room.bytes()

    def total_bytes(self) -> int:
        return self.room.counts.total()

    def queued_bytes(self) -> int:
        """Bytes not yet on the wire: the socket's, and the channel's queue and buffer."""
        n = self.socket.queued_bytes()
        if self.path is not None:
            n += self.path.buffered(self.channel.buffered_bytes() if self.channel is not None else 0)
        return n

    def pressure(self) -> float:
        return self.room.pressure(self.queued_bytes())

    def quantize(self, params: Any) -> Any:
        return (self.writer or FrameWriter(0, precision=self.precision, int8_block=self.int8_block,
                                           use_numpy=self.use_numpy)).quantize(params)

    def set_silence_bound_ms(self, bound_ms: float) -> None:
        """Nothing: a star's one path is its socket to the server (``RoomBus``)."""
        check_bound_ms(bound_ms)

    def set_precision(self, precision: str) -> None:
        """Send at ``precision`` from now on.

        Raises:
            ConfigError: an unknown precision.
        """
        size = self.writer.max_message_bytes if self.writer is not None else self.max_message_bytes
        w = FrameWriter(self.id, precision=precision, max_message_bytes=size, int8_block=self.int8_block,
                        use_numpy=self.use_numpy)
        self.precision = precision
        if self.writer is not None:
            self.writer = w

    def drops(self) -> dict[str, int]:
        return merge_counts(self.reader.drops, self.room.drops,
                            self.connector.drops if self.connector is not None else {})

    def paths(self) -> dict[int, str]:
        """The server's path (key 0): ``rtc`` while the channel carries chunks, else ``ws``."""
        p = self.path
        return {0: "rtc" if p is not None and p.state is PathState.DIRECT else "ws"}

    def pair_bytes(self) -> None:
        """None: a star has one path, the server's (``transport_bytes``)."""
        return None

    def supervise_ticks(self) -> None:
        return None

    def transport_bytes(self) -> dict[str, int]:
        """Chunk bytes this rank's link carried (up + down) on the channel and on the socket."""
        p = self.path
        rtc_out, rtc_in = (p.direct_sent, p.direct_received) if p is not None else (0, 0)
        return {"rtc": rtc_out + rtc_in, "ws": self.ws_chunk_bytes_out + self.chunk_bytes_in - rtc_in}

    def held_bytes(self) -> int:
        """Chunk bytes taken off the wire while stalled and held (tests)."""
        return sum(len(c) for c, _ in self._held)

    def stall(self, stalled: bool) -> None:
        """Tests: stop (True) / resume (False) taking data off the socket and the channel (held,
        not lost; reported as ``backlog`` when the adapter cannot pause)."""
        self.stalled = stalled
        if self.socket.can_pause:
            self.socket.pause(stalled)
        if self.channel is not None and self.connector.can_pause:
            self.channel.pause(stalled)
        if not stalled:
            held, self._held, self._held_bytes = self._held, [], 0
            for chunk, direct in held:
                self._take(chunk, direct)
            self._report_backlog()

    # ------------------------------------------------------------------ the socket's events
    def on_open(self) -> None:
        self._reached = True
        if not self.closed:   # (the server counts a rank's messages from its welcome on)
            self.socket.send_text(json.dumps(self.room.register()))

    def on_text(self, text: str) -> None:
        if self.closed:
            return
        self.n_received += 1
        self.downlink_bytes += len(text)
        try:
            obj = json.loads(text)
        except ValueError:
            self.room.count("bad_control")
            return
        resumed = self.room.resuming
        obj = self.room.control(obj)
        if obj is None:
            return
        t = obj.get("type")
        if t == "welcome":
            m = obj.get("max_message_bytes")   # the largest message the server reads
            if isinstance(m, int) and not isinstance(m, bool) and m >= 4096:
                self.server_max_message_bytes = m
            if isinstance(m, int) and not isinstance(m, bool) and m >= 4096 and m < self.max_message_bytes:
                self.max_message_bytes = m
                if self.writer is not None and self.writer.max_message_bytes > m:
                    self.writer.max_message_bytes = m
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            fut = self._welcome
            if fut is not None and not fut.done():
                fut.set_result(None)
            if resumed:
                log.info("rank %08x: reconnected", self.id)
        elif t == "signal" and obj.get("from") == 0 and self.channel is not None:
            if obj.get("kind") == "answer" and isinstance(obj.get("sdp"), str):
                self.channel.signal({"kind": "answer", "sdp": obj["sdp"]})
            return
        self._emit(obj)

    def on_chunk(self, chunk: bytes) -> None:
        if self.closed:
            return
        self.n_received += 1
        self.downlink_bytes += len(chunk)
        self._arrive(chunk, False)

    def on_conflated(self, sender: Any, frames: int, chunks: int, n_bytes: int) -> None:
        """Superseded round frames the socket adapter dropped unread (PROTOCOL.md, "Follower:
        receiving messages"): their bytes count as received; each frame as ``round_superseded``."""
        if not self.closed:
            self._conflated(sender, frames, chunks, n_bytes)

    def _conflated(self, sender: Any, frames: int, chunks: int, n_bytes: int) -> None:
        self.n_received += chunks
        self.downlink_bytes += n_bytes
        self.chunk_bytes_in += n_bytes
        self.room.count("round_superseded", frames)
        if not isinstance(sender, int) or isinstance(sender, bool):
            return
        if self.relay_sink is None:
            self.room.count_received(sender, n_bytes)
        elif self.relay_conflated is not None:
            self.relay_conflated(sender, n_bytes)

    def _open_socket(self, url: str) -> None:
        self._reached = False
        self.socket.open(url, self)

    def on_closed(self, code: int | None, reason: str) -> None:
        fut = self._welcome
        if self.closed:
            return
        reached, self._reached = self._reached, False
        if self.room.connected:
            if code == CLOSE_MOVED:   # the node lost the room: the reason names the owner
                self.room.moved(reason)
        else:   # an attempt that has no welcome yet: follow a cluster's redirect within it
            to, code = self.room.redirect(code, reason, reached=reached)
            if to is not None:
                log.info("rank %08x: the room is served at %s; following", self.id, to)
                self._open_socket(to)
                return
        if fut is not None and not fut.done() and not self.room.resuming:
            what = f"close {code}: {reason}" if code is not None else reason
            fut.set_exception(LinkFailed(f"server refused the link ({what})" if code is not None
                                         else f"cannot connect to {self.room.url}: {reason}", code, reason))
            return
        if self._timer is not None:   # this attempt's watchdog: one attempt at a time
            self._timer.cancel()
            self._timer = None
        n = self.socket.discard()
        if n:
            self.room.count("disconnected", n)
        was = self.room.connected
        if was and self.room.peers:
            # every peer's path was this link: they are out of reach until heard from again
            # (docs/PROTOCOL.md "Membership and majority": a leader must not go on alone)
            self._emit({"type": "unreachable", "ids": sorted(self.room.peers)})
        at = self.room.lost(code, now_ms=self.now_ms(), reason=reason)
        if at is None:
            (log.warning if self.room.rejoin else log.error)("rank %08x: %s", self.id, self.room.failed)
            self._emit(self.room.fail(self.room.failed or "link lost"))
            return
        if was:
            log.warning("rank %08x: link lost (code %s); reconnecting", self.id, code)
        # (a delay, never a deadline: Pyodide's call_at reads the clock again and refuses one
        # already past, which would leave the rank neither reconnecting nor failed)
        self._timer = self._loop.call_later(max(0.0, (at - self.now_ms()) / 1000.0), self._attempt)

    def _attempt(self) -> None:
        """A reconnect attempt (a deadline from :meth:`RoomClient.lost` passed)."""
        self._timer = self._loop.call_later(ATTEMPT_TIMEOUT_S, self._attempt_timed_out)
        self._open_socket(self.room.new_attempt())

    def _attempt_timed_out(self) -> None:
        self._timer = None
        self.socket.close()
        self.on_closed(None, f"no welcome within {ATTEMPT_TIMEOUT_S:g} s")

    def _emit(self, obj: dict) -> None:
        if self.on_control is not None:
            try:
                self.on_control(obj)
            except Exception:
                log.exception("on_control callback failed")

    # ------------------------------------------------------------------ inbound chunks
    def _arrive(self, chunk: bytes, direct: bool) -> None:
        if self.stalled:
            self._held.append((chunk, direct))
            can_pause = self.connector.can_pause if direct else self.socket.can_pause
            if not can_pause:
                self._held_bytes += len(chunk)
                self._report_backlog()
            return
        self._take(chunk, direct)

    def _take(self, chunk: bytes, direct: bool) -> None:
        if self.closed:
            return
        self.chunk_bytes_in += len(chunk)
        if self.relay_sink is not None:
            self.relay_sink(chunk)
            return
        try:
            sender = parse_route(chunk).sender
        except RemoteProtocolError:
            sender = 0
        self.room.count_received(sender, len(chunk))
        for m in self.reader.feed(chunk, now_ms=self.now_ms()):
            cb = self.on_message
            if cb is not None and not self.closed:
                cb(m)

    def _report_backlog(self) -> None:
        ctl = self.room.backlog(self._held_bytes)
        if ctl is not None and not self.closed:
            self._send_text(json.dumps(ctl))

    # ------------------------------------------------------------------ the channel's events
    def channel_open(self, ch: Any, max_message_bytes: int) -> None:
        if ch is not self.channel or self.closed or self.path.state is not PathState.CONNECTING:
            return
        self.path.opened(max_message_bytes, now_ms=self.now_ms())
        if self.writer is not None:
            self.writer.max_message_bytes = max_message_bytes
        if self.stalled and self.connector.can_pause:
            ch.pause(True)
        log.info("rank %08x: WebRTC star link open (max message %d)", self.id, max_message_bytes)

    def channel_chunk(self, ch: Any, chunk: bytes, owned: bool = False) -> None:
        if ch is self.channel and not self.closed:
            self.path.received_chunk(len(chunk), direct=True, now_ms=self.now_ms())
            self.n_received += 1
            self.downlink_bytes += len(chunk)
            self._arrive(chunk, True)

    def channel_progress(self, ch: Any) -> None:
        if ch is self.channel and not self.closed:
            self.path.last_rx_ms = self.now_ms()

    def channel_conflated(self, ch: Any, sender: Any, frames: int, chunks: int, n_bytes: int) -> None:
        if ch is self.channel and not self.closed:
            self.path.received_chunk(n_bytes, direct=True, now_ms=self.now_ms())
            self._conflated(sender, frames, chunks, n_bytes)

    def channel_low(self, ch: Any) -> None:
        if ch is self.channel:
            self._drain()

    def channel_down(self, ch: Any, why: str) -> None:
        if ch is self.channel:
            self._channel_lost(why)

    def channel_signal(self, ch: Any, signal: dict) -> None:
        if ch is self.channel and signal.get("kind") == "offer":
            self.send_control({**signal, "type": "signal", "to": 0})

    def _drain(self) -> None:
        ch, p = self.channel, self.path
        if ch is None or p is None:
            return
        p.pump(ch, self.channel_high_water_bytes)

    def _channel_lost(self, why: str) -> None:
        """The channel to the server is gone (or never came up): the socket carries the chunks
        from now on, those still queued for the channel first, in order."""
        p = self.path
        if p is None or p.state is PathState.RELAY or self.closed:
            return
        held = p.unqueue()
        p.fallback(why)
        log.warning("rank %08x: star link uses the WebSocket: %s", self.id, why)
        if held and self.connected:
            size = sum(map(len, held))
            p.sent -= size
            p.direct_sent -= size
            self.ws_chunk_bytes_out += size
            self.socket.send_chunks(held)
        ch, self.channel = self.channel, None
        if ch is not None:
            ch.close()

