"""Native transport adapters: an aiohttp WebSocket to the server and aiortc data channels,
and the factories that compose them into the star and mesh buses (docs/INTERFACES.md, "Bus").

aiohttp and aiortc are imported inside the adapters, so importing ``tabcohort.bus`` needs
neither. :func:`star_bus` makes ``ws-star`` (``link="ws"``) or ``rtc-star`` (``link="rtc"``: a
data channel to the server, which terminates it with aiortc); :func:`mesh_bus` makes
``rtc-mesh`` (a data channel per pair, the relay as each pair's fallback); :func:`direct_bus`
makes ``tcp-mesh`` (native ranks in a star room: a TCP connection of its own per pair of native
ranks, :class:`TcpConnector`, the relay for every other pair and as each pair's fallback).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import socket
import urllib.parse
from collections import deque
from typing import Any, Sequence

from ..errors import ConfigError
from ..wire import DATA_CHANNEL_MAX_MESSAGE_BYTES
from . import direct
from .path import CHANNEL_CLOSED, CLOSED_BY_PEER, PathKind

from ..wire.codecs import DEFAULT_INT8_BLOCK
from .mesh import MeshBus
from .rtc_util import (CHANNEL_LABEL, MAX_REMOTE_CANDIDATES, add_candidate, configuration, gate_receive,
                       negotiated_max_message_bytes, parse_candidate, parse_ice_servers, set_host_addresses)
from .star import ChannelListener, SocketListener, StarBus

#: the native rank's chunk size on its WebSocket (the server reads up to 256 KiB + 1 KiB)
WS_MAX_MESSAGE_BYTES = DATA_CHANNEL_MAX_MESSAGE_BYTES
#: the direct path's bound on coming up (then the pair uses the relay), seconds
DIRECT_CONNECT_TIMEOUT_S = 3.0
#: bytes of a direct path's transport buffer at which the bus stops handing it chunks
DIRECT_WRITE_HIGH_BYTES = 256 << 10

log = logging.getLogger("tabcohort.bus.aio")


class AiohttpSocket:
    """The rank's WebSocket to the server (aiohttp): a send queue drained in order by one task,
    a receive task that stops reading while paused (the server then sees its writes back up).

    Args:
        heartbeat_s: WebSocket ping period.
        max_msg_size: the largest message accepted from the server, bytes.
    """

    can_pause = True

    def __init__(self, *, heartbeat_s: float = 10.0, max_msg_size: int = 1 << 20) -> None:
        self.heartbeat_s = heartbeat_s
        self.max_msg_size = max_msg_size
        self._session: Any = None
        self._ws: Any = None
        self._queue: deque[bytes | str] = deque()
        self._queued = 0
        self._wake: asyncio.Event | None = None
        self._gate: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def open(self, url: str, listener: SocketListener) -> None:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession()
            self._wake, self._gate = asyncio.Event(), asyncio.Event()
            self._gate.set()
        self._loop = asyncio.get_running_loop()
        if self._task is not None:   # one socket at a time: a new attempt replaces the last
            self._task.cancel()
        self._task = self._loop.create_task(self._run(url, listener))

    async def _run(self, url: str, listener: SocketListener) -> None:
        import aiohttp

        try:
            ws = await self._session.ws_connect(url, heartbeat=self.heartbeat_s, max_msg_size=self.max_msg_size,
                                                autoping=True)
        except (OSError, aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            listener.on_closed(None, f"{type(e).__name__}: {e}")
            return
        self._ws = ws
        sender = asyncio.get_running_loop().create_task(self._send(ws))
        try:
            listener.on_open()
            while True:
                await self._gate.wait()
                msg = await ws.receive()
                await self._gate.wait()   # a pause that began mid-receive holds this one too
                if msg.type == aiohttp.WSMsgType.BINARY:
                    listener.on_chunk(msg.data)
                elif msg.type == aiohttp.WSMsgType.TEXT:
                    listener.on_text(msg.data)
                else:
                    break
        except asyncio.CancelledError:
            self._loop.create_task(self._close_ws(ws))   # replaced or closed: this socket goes too
            raise
        finally:
            sender.cancel()
        self._ws = None
        listener.on_closed(ws.close_code, str(getattr(msg, "extra", None) or ""))

    async def _send(self, ws: Any) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                item = self._queue[0]
                try:
                    if isinstance(item, str):
                        await ws.send_str(item)
                    else:
                        await ws.send_bytes(item)
                except (ConnectionError, RuntimeError, OSError):
                    return   # the receive task notices the closed socket
                if self._queue and self._queue[0] is item:
                    self._queue.popleft()
                    self._queued -= len(item)

    def _push(self, items: list) -> None:
        self._queue.extend(items)
        self._queued += sum(map(len, items))
        self._wake.set()

    def send_chunks(self, chunks: list[bytes]) -> None:
        self._push(chunks)

    def send_text(self, text: str) -> None:
        self._push([text])

    def queued_bytes(self) -> int:
        return self._queued

    def discard(self) -> int:
        n = len(self._queue)
        self._queue.clear()
        self._queued = 0
        return n

    def pause(self, paused: bool) -> None:
        if self._gate is not None:
            (self._gate.clear if paused else self._gate.set)()

    def close(self) -> None:
        t, self._task = self._task, None
        if t is not None:
            t.cancel()
        ws = self._ws
        if ws is not None and not ws.closed and not self._loop.is_closed():
            self._loop.create_task(self._close_ws(ws))   # (close may be called between loop runs)

    @staticmethod
    async def _close_ws(ws: Any) -> None:
        try:
            await asyncio.wait_for(ws.close(), 2.0)
        except (asyncio.TimeoutError, OSError):
            pass

    async def aclose(self) -> None:
        t, self._task = self._task, None
        if t is not None:
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)
        ws, self._ws = self._ws, None
        if ws is not None and not ws.closed:
            await self._close_ws(ws)
        s, self._session = self._session, None
        if s is not None:
            await s.close()


class AiortcChannel:
    """One aiortc ``RTCPeerConnection`` with one data channel (ordered, reliable, binary)."""

    def __init__(self, connector: "AiortcConnector", peer: int, listener: ChannelListener,
                 offer_sdp: str | None) -> None:
        from aiortc import RTCPeerConnection

        self.connector, self.peer, self.listener = connector, peer, listener
        self.closed = False
        self.n_candidates = 0   # remote candidates taken (rtc_util.MAX_REMOTE_CANDIDATES)
        self.dc: Any = None
        self._gate: asyncio.Event | None = None
        self._loop = asyncio.get_running_loop()
        pc = self.pc = RTCPeerConnection(configuration(connector.ice_servers))

        @pc.on("connectionstatechange")
        def _state() -> None:
            if pc.connectionState in ("failed", "closed") and not self.closed:
                listener.channel_down(self, f"peer connection {pc.connectionState}")

        if offer_sdp is None:
            self._setup(pc.createDataChannel(CHANNEL_LABEL, ordered=True))
            connector.spawn(self._offer())
        else:
            pc.on("datachannel", self._setup)
            connector.spawn(self._answer(offer_sdp))

    def _setup(self, dc: Any) -> None:
        if self.closed:
            dc.close()
            return
        self.dc = dc
        dc.bufferedAmountLowThreshold = self.connector.channel_low_water_bytes

        def opened() -> None:
            if self.dc is dc and not self.closed:
                self.listener.channel_open(self, negotiated_max_message_bytes(self.pc))

        @dc.on("message")
        def _message(data: Any) -> None:
            if isinstance(data, (bytes, bytearray)) and self.dc is dc and not self.closed:
                self.listener.channel_chunk(self, bytes(data))

        dc.on("bufferedamountlow", lambda: self.listener.channel_low(self))

        @dc.on("close")
        def _closed() -> None:
            if self.dc is dc and not self.closed:
                self.listener.channel_down(self, CHANNEL_CLOSED)

        if dc.readyState == "open":
            opened()
        else:
            dc.on("open", opened)

    async def _offer(self) -> None:
        pc = self.pc
        await pc.setLocalDescription(await pc.createOffer())
        if not self.closed:
            self.listener.channel_signal(self, {"kind": "offer", "sdp": pc.localDescription.sdp})

    async def _answer(self, sdp: str) -> None:
        from aiortc import RTCSessionDescription

        pc = self.pc
        await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
        await pc.setLocalDescription(await pc.createAnswer())
        if not self.closed:
            self.listener.channel_signal(self, {"kind": "answer", "sdp": pc.localDescription.sdp})

    async def _accept(self, sdp: str) -> None:
        from aiortc import RTCSessionDescription

        if self.pc.signalingState == "have-local-offer":
            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="answer"))

    def signal(self, signal: dict) -> None:
        """A remote ``answer`` (``sdp``) or trickled ``candidate`` (a dict) for this channel."""
        if self.closed:
            return
        if signal.get("kind") == "answer" and isinstance(signal.get("sdp"), str):
            self.connector.spawn(self._accept(signal["sdp"]))
        elif signal.get("kind") == "candidate" and isinstance(signal.get("candidate"), dict):
            if self.n_candidates >= MAX_REMOTE_CANDIDATES:   # (a peer's flood: rtc_util)
                self.connector.count("rtc_candidate_limit")
                return
            self.n_candidates += 1
            try:
                cand = parse_candidate(signal["candidate"])
            except ValueError:
                self.connector.count("rtc_bad_candidate")
                return
            self.connector.spawn(add_candidate(self.pc, cand))

    def buffered_bytes(self) -> int:
        dc = self.dc
        return dc.bufferedAmount if dc is not None else 0

    def send(self, chunks: list[bytes]) -> bool:
        dc = self.dc
        if dc is None or dc.readyState != "open" or self.closed:
            return False
        if asyncio._get_running_loop() is not self._loop:
            # a synchronous caller between loop runs: aiortc schedules its flush on the running
            # loop, so send from inside it
            self._loop.call_soon(self.send, chunks)
            return False
        for c in chunks:
            dc.send(c)
        return True

    def pause(self, paused: bool) -> None:
        """Stop (True) or resume reading datagrams (tests: a black-holed consumer; aioice keeps
        them, so the sender sees no SCTP acks and its ``bufferedAmount`` grows)."""
        if self._gate is None:
            self._gate = asyncio.Event()
        (self._gate.clear if paused else self._gate.set)()
        if getattr(self.pc, "sctp", None) is not None:
            gate_receive(self.pc, self._gate)

    def idle(self) -> bool:
        """Nothing of ours in aiortc's SCTP queues (everything acknowledged by the peer)."""
        sctp = getattr(self.pc, "sctp", None)
        return sctp is None or not any(getattr(sctp, q, None) for q in
                                       ("_data_channel_queue", "_outbound_queue", "_sent_queue"))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if not self._loop.is_closed():
                self.connector.spawn(self.pc.close())


class _Tasks:
    """The background tasks of one connector (negotiations, dials, closes): each runs on the
    loop its channels were opened on; failures are logged as ``what`` and never raised."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.loop: asyncio.AbstractEventLoop | None = None
        self.running: set[asyncio.Task] = set()

    def spawn(self, coro: Any) -> None:
        t = self.loop.create_task(coro)
        self.running.add(t)
        t.add_done_callback(self._done)

    def _done(self, t: asyncio.Task) -> None:
        self.running.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.warning("%s failed: %r", self.what, t.exception())

    async def wait(self, *, cancel: bool = False) -> None:
        if cancel:
            for t in list(self.running):
                t.cancel()
        if self.running:
            await asyncio.wait(set(self.running), timeout=5.0)


class AiortcConnector:
    """Makes :class:`AiortcChannel` s (see :class:`tabcohort.bus.star.Connector`).

    Args:
        ice_servers: STUN/TURN URLs (``turn:user:pass@host:port``); none by default.
        host_addresses: ICE host candidate addresses (``None`` = aioice's own list;
            process-wide, see ``rtc_util``).
        channel_low_water_bytes: ``bufferedAmountLowThreshold`` of each channel.

    Raises:
        ConfigError: a bad ICE server URL or host address.
    """

    can_pause = True

    def __init__(self, *, ice_servers: Sequence[str] | str | None = None, host_addresses: Sequence[str] | None = None,
                 channel_low_water_bytes: int = 256 << 10) -> None:
        self.ice_servers = parse_ice_servers(ice_servers)
        if host_addresses is not None:
            set_host_addresses(list(host_addresses))
        self.channel_low_water_bytes = channel_low_water_bytes
        self.drops: dict[str, int] = {}
        self._tasks = _Tasks("a peer-connection task")

    def check(self) -> None:
        import aiortc  # noqa: F401  (fail here, before any network activity, if missing)

    def open(self, peer: int, listener: ChannelListener, *, offer_sdp: str | None = None) -> AiortcChannel:
        self._tasks.loop = asyncio.get_running_loop()
        return AiortcChannel(self, peer, listener, offer_sdp)

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` on the channels' loop (callable between loop runs); failures are logged."""
        self._tasks.spawn(coro)

    def count(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1

    async def aclose(self) -> None:
        await self._tasks.wait()


def ws_url(server: str, room: str) -> str:
    """``http(s)://host:port`` (or ``ws(s)://``) + room -> the room's relay WebSocket URL."""
    base = server.rstrip("/")
    if base.startswith("http://"):
        base = "ws://" + base[7:]
    elif base.startswith("https://"):
        base = "wss://" + base[8:]
    return f"{base}/api/rooms/{room}/ws"


def star_bus(url: str, *, link: str = "ws", ice_servers: Sequence[str] | str | None = None,
             host_addresses: Sequence[str] | None = None, heartbeat_s: float = 10.0,
             channel_low_water_bytes: int = 256 << 10, **kw: Any) -> StarBus:
    """A native star bus: ``link="ws"`` (chunks on the WebSocket) or ``"rtc"`` (on a data channel
    to the server while it is open). ``kw``: as for :class:`~tabcohort.bus.star.StarBus`."""
    connector = AiortcConnector(ice_servers=ice_servers, host_addresses=host_addresses,
                                channel_low_water_bytes=channel_low_water_bytes) if link == "rtc" else None
    # chunks of 256 KiB on the WebSocket (at most what the server's welcome says it reads): 64 KiB
    # chunks cost 10-40 % more round time for 1M float32 (bench/bench_anchors.py, README
    # "Performance"); a data channel takes what it negotiated
    kw.setdefault("max_message_bytes", WS_MAX_MESSAGE_BYTES)
    return StarBus(AiohttpSocket(heartbeat_s=heartbeat_s), url, connector=connector, **kw)


def mesh_bus(url: str, *, ice_servers: Sequence[str] | str | None = None, host_addresses: Sequence[str] | None = None,
             heartbeat_s: float = 10.0, channel_low_water_bytes: int = 256 << 10, token: str | None = None,
             trainer_token: str | None = None, reconnect_max_s: float = 30.0, **kw: Any) -> MeshBus:
    """A native mesh bus over aiortc (``kw``: as for :class:`~tabcohort.bus.mesh.MeshBus`)."""
    connector = AiortcConnector(ice_servers=ice_servers, host_addresses=host_addresses,
                                channel_low_water_bytes=channel_low_water_bytes)
    relay = StarBus(AiohttpSocket(heartbeat_s=heartbeat_s), url, token=token, trainer_token=trainer_token,
                    reconnect_max_s=reconnect_max_s,
                    precision=kw.get("precision", "f32"), int8_block=kw.get("int8_block", DEFAULT_INT8_BLOCK),
                    use_numpy=kw.get("use_numpy"))
    return MeshBus(relay, connector, **kw)


class _TcpStream(asyncio.BufferedProtocol):
    """One TCP connection of a direct path: the handshake, then length-prefixed chunks
    (:mod:`tabcohort.bus.direct`), each read straight into a buffer of its own length (no copy
    between the socket and the wire reader). Inbound connections are handed to their channel
    once the dialler proved it holds the pair's key."""

    def __init__(self, connector: "TcpConnector", channel: "TcpChannel | None") -> None:
        self.connector = connector
        self.channel = channel          # None: inbound, not yet matched to an offer
        self.transport: Any = None
        self.nonce: bytes | None = None
        self.open = False
        #: the handshake message being read (then the chunk stream)
        self.target = bytearray(direct.HELLO.size if channel is None else direct.ACCEPT_BYTES)
        self.filled = 0
        self.state = "hello" if channel is None else "accept"
        self.stream: direct.ChunkStream | None = None
        #: the transport's buffer is over its high-water mark (resume_writing will follow)
        self.write_paused = False
        self.up = asyncio.get_running_loop().create_future()
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=DIRECT_WRITE_HIGH_BYTES, low=DIRECT_WRITE_HIGH_BYTES // 4)
        c = self.connector
        if self.channel is None:   # inbound: the dialler must prove itself within the bound
            self._timer = asyncio.get_running_loop().call_later(c.handshake_timeout_s, self._handshake_late)
        else:
            ch = self.channel
            if ch.closed:             # given up while connecting (the connect bound passed)
                transport.abort()
                return
            ch.dialing = self         # closed with the channel, handshake done or not
            self.nonce = os.urandom(direct.NONCE_BYTES)
            transport.write(direct.dial_hello(ch.key, ch.peer, ch.own_id, self.nonce))

    def _handshake_late(self) -> None:
        if not self.open:
            self.connector.count("direct_handshake_timeout")
            self.transport.abort()

    def _refuse(self, reason: str) -> None:
        self.connector.count(reason)
        self.state = "closed"
        self.transport.abort()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.stream is not None:
            return self.stream.buffer()
        return memoryview(self.target)[self.filled:]

    def buffer_updated(self, nbytes: int) -> None:
        st = self.stream
        if st is not None:
            chunks = st.advance(nbytes)
            ch = self.channel
            for chunk in chunks:
                if ch.closed:
                    break
                ch.listener.channel_chunk(ch, chunk, owned=True)   # (a buffer of its own: direct.ChunkStream)
            if st.error is not None and not ch.closed:
                self.connector.count("direct_bad_chunk")
                ch.down(f"direct path: {st.error}")
            elif not chunks and not ch.closed:
                # part of a chunk: on a slow link a 4 MiB chunk takes seconds, and the peer's
                # beats wait behind it; its bytes keep the path's idle bound from expiring
                ch.listener.channel_progress(ch)
            return
        self.filled += nbytes
        if self.filled < len(self.target):
            return
        data, self.filled = bytes(self.target), 0
        if self.state == "hello":
            self._inbound_handshake(data)
        elif self.state == "accept":
            self._outbound_handshake(data)
        # (closed: what still arrives overwrites the scratch buffer until the transport goes)

    def _inbound_handshake(self, data: bytes) -> None:
        h = direct.read_hello(data)
        if h is None:
            return self._refuse("direct_bad_hello")
        listener_id, dialler, nonce, mac = h
        ch = self.connector.pending.get(dialler)
        if ch is None or listener_id != ch.own_id or ch.key is None:
            return self._refuse("direct_unexpected")
        if not direct.hello_valid(ch.key, listener_id, dialler, nonce, mac):
            return self._refuse("direct_auth_failed")
        del self.connector.pending[dialler]   # the key opens one connection
        self.transport.write(direct.accept_mac(ch.key, listener_id, dialler, nonce))
        self.channel = ch
        self._open()

    def _outbound_handshake(self, data: bytes) -> None:
        ch = self.channel
        if not hmac.compare_digest(data, direct.accept_mac(ch.key, ch.peer, ch.own_id, self.nonce)):
            self._refuse("direct_auth_failed")
            return
        self._open()

    def _open(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.open = True
        self.state = "open"
        self.stream = direct.ChunkStream(direct.DIRECT_MAX_MESSAGE_BYTES)   # (the chunk header included)
        if not self.up.done():
            self.up.set_result(None)
        self.channel.attach(self)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        ch = self.channel
        if ch is not None and ch.stream is self and not ch.closed:
            ch.listener.channel_low(ch)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if not self.up.done():
            self.up.set_exception(ConnectionError(f"closed during the handshake ({exc!r})"))
            self.up.exception()   # (retrieved: the dialler reads it, an inbound one has no reader)
        ch = self.channel
        if ch is not None and ch.stream is self:
            ch.down(f"direct connection lost ({exc!r})" if exc else CLOSED_BY_PEER)


class TcpChannel:
    """A direct path's channel to one peer (see :class:`tabcohort.bus.star.Channel`): it offers
    (listens, announces) or answers an offer (dials), then carries chunks on the connection."""

    def __init__(self, connector: "TcpConnector", peer: int, listener: ChannelListener,
                 offer: dict | None) -> None:
        self.connector, self.peer, self.listener = connector, peer, listener
        self.own_id: int = getattr(listener, "id")
        self.closed = False
        self.stream: _TcpStream | None = None
        #: this rank's outbound connection from connect to close (``stream`` once handed over)
        self.dialing: _TcpStream | None = None
        self.paused = False
        self.key: bytes | None = None
        self._low_due = False
        self._loop = asyncio.get_running_loop()
        if offer is None:
            connector.spawn(self._offer())
        else:
            addr, key = direct.parse_addr(offer.get("addr")), direct.parse_key(offer.get("key"))
            if addr is None or key is None:
                connector.count("bad_direct_offer")
                self._loop.call_soon(self.down, "the peer's direct offer is malformed")
            else:
                self.key = key
                connector.spawn(self._dial(*addr))

    async def _offer(self) -> None:
        try:
            addr = await self.connector.listening()
        except OSError as e:
            self.down(f"cannot listen for direct connections: {e}")
            return
        if self.closed:
            return
        self.key = os.urandom(direct.KEY_BYTES)
        self.connector.pending[self.peer] = self
        self.listener.channel_signal(self, {"kind": "direct", "addr": addr, "key": self.key.hex()})

    async def _dial(self, host: str, port: int) -> None:
        c = self.connector
        try:
            _, proto = await asyncio.wait_for(self._loop.create_connection(
                lambda: _TcpStream(c, self), host, port,
                local_addr=(c.bind_host, 0) if c.bind_host else None), c.connect_timeout_s)
            await asyncio.wait_for(asyncio.shield(proto.up), c.connect_timeout_s)
        except (OSError, asyncio.TimeoutError, ConnectionError) as e:
            c.count("direct_unreachable")
            self.down(f"direct connection to {direct.format_addr(host, port)} failed: {e!r}")

    def attach(self, stream: _TcpStream) -> None:
        if self.closed:
            stream.transport.abort()
            return
        self.stream = stream
        if self.paused:
            stream.transport.pause_reading()
        self.listener.channel_open(self, direct.DIRECT_MAX_MESSAGE_BYTES)

    def down(self, why: str) -> None:
        if not self.closed:
            self.close()
            self.listener.channel_down(self, why)

    def buffered_bytes(self) -> int:
        s = self.stream
        return s.transport.get_write_buffer_size() if s is not None and not s.transport.is_closing() else 0

    def send(self, chunks: list[bytes]) -> bool:
        s = self.stream
        if s is None or self.closed or s.transport.is_closing():
            return False
        w = s.transport.write
        for c in chunks:   # (no join: a copy of every chunk; the prefix is a 4-byte write)
            w(direct.LEN.pack(len(c)))
            # a view: what the kernel does not take at once is copied once, into the
            # transport's buffer (a ``bytes`` tail is sliced off as a copy first)
            w(memoryview(c))
        # the transport is not over its high-water mark (the kernel took most of it), so no
        # resume_writing will come: ask the bus for more on the next loop turn
        if not self._low_due and not s.write_paused:
            self._low_due = True
            self._loop.call_soon(self._low)
        return not s.transport.is_closing()   # (a write error closes it at once)

    def _low(self) -> None:
        self._low_due = False
        if not self.closed and self.stream is not None:
            self.listener.channel_low(self)

    def signal(self, signal: dict) -> None:
        """Nothing to trickle on a direct path."""

    def pause(self, paused: bool) -> None:
        self.paused = paused
        s = self.stream
        if s is not None and not s.transport.is_closing():
            (s.transport.pause_reading if paused else s.transport.resume_reading)()

    def idle(self) -> bool:
        return self.buffered_bytes() == 0

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.connector.pending.get(self.peer) is self:
            del self.connector.pending[self.peer]
        s = self.stream
        if s is not None:
            s.transport.close()
        d = self.dialing
        if d is not None and d is not s and d.transport is not None:
            d.transport.abort()       # a connection still in its handshake: nothing to flush


class TcpConnector:
    """Makes :class:`TcpChannel` s: direct TCP paths between native ranks (see
    :class:`tabcohort.bus.star.Connector` and :mod:`tabcohort.bus.direct`).

    One listening socket per rank (an ephemeral port on ``host``), opened at the first offer.

    Args:
        host: the address to listen on and announce (an IP literal).
        announce: ``host:port`` to announce instead of the listening address (a port forward).
        bind_host: the local address outbound connections come from (``None``: the system's choice).
        connect_timeout_s: the bound on dialling and on the handshake.

    Raises:
        ConfigError: ``host`` is not an IP address, or ``announce`` is not ``IP:PORT``.
    """

    can_pause = True
    offer_kind = "direct"
    path_kind = PathKind.TCP
    ice_servers: list[str] = []

    def __init__(self, *, host: str, announce: str | None = None, bind_host: str | None = None,
                 connect_timeout_s: float = DIRECT_CONNECT_TIMEOUT_S, handshake_timeout_s: float = 5.0) -> None:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError("--direct-host", host, "expected an IP address, e.g. 127.0.0.1") from None
        if announce is not None and direct.parse_addr(announce) is None:
            raise ConfigError("--direct-announce", announce, "expected IP:PORT, e.g. 192.0.2.7:40100")
        self.host, self.announce, self.bind_host = host, announce, bind_host
        self.connect_timeout_s = connect_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.drops: dict[str, int] = {}
        #: peer id -> the channel whose offer (key) waits for that peer's connection
        self.pending: dict[int, TcpChannel] = {}
        self.server: asyncio.AbstractServer | None = None
        self._listening: asyncio.Future | None = None
        self._tasks = _Tasks("a direct-path task")

    def check(self) -> None:
        """Nothing to import: asyncio does the I/O."""

    def count(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1

    async def listening(self) -> str:
        """The announced address once listening (the first call binds).

        Raises:
            OSError: the address cannot be bound.
        """
        if self._listening is None:
            self._listening = asyncio.get_running_loop().create_task(self._listen())
        return await asyncio.shield(self._listening)

    async def _listen(self) -> str:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _TcpStream(self, None), self.host, 0)
        port = self.server.sockets[0].getsockname()[1]
        addr = self.announce or direct.format_addr(self.host, port)
        log.info("direct paths: listening on %s (announced %s)", direct.format_addr(self.host, port), addr)
        return addr

    def open(self, peer: int, listener: ChannelListener, *, offer: dict | None = None,
             offer_sdp: str | None = None) -> TcpChannel:
        self._tasks.loop = asyncio.get_running_loop()
        return TcpChannel(self, peer, listener, offer)

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` on the channels' loop; failures are logged."""
        self._tasks.spawn(coro)

    async def aclose(self) -> None:
        await self._tasks.wait(cancel=True)
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        if self._listening is not None and not self._listening.done():
            self._listening.cancel()


def route_address(url: str) -> str:
    """The local address this host would use to reach ``url``'s host (a connected UDP socket:
    nothing is sent). ``127.0.0.1`` when that cannot be told."""
    u = urllib.parse.urlsplit(url)
    host = u.hostname or "127.0.0.1"
    try:
        info = socket.getaddrinfo(host, u.port or 80, type=socket.SOCK_DGRAM)
        fam, _, _, _, sa = info[0]
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect(sa)
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def direct_bus(url: str, *, direct_host: str | None = None, direct_announce: str | None = None,
               heartbeat_s: float = 10.0, token: str | None = None, trainer_token: str | None = None,
               reconnect_max_s: float = 30.0, connect_timeout_s: float = DIRECT_CONNECT_TIMEOUT_S,
               **kw: Any) -> MeshBus:
    """A native rank's bus in a star room with direct paths (``tcp-mesh``): the star relay, plus
    a TCP connection per pair of native ranks that reach each other (docs/PROTOCOL.md, "Direct
    TCP path"). ``direct_host``: where to listen (default: the local address that routes to the
    server); outbound connections come from it too. ``kw``: as for
    :class:`~tabcohort.bus.mesh.MeshBus`.

    Raises:
        ConfigError: a bad ``direct_host`` / ``direct_announce`` (before any network activity).
    """
    host = direct_host if direct_host is not None else route_address(url)
    connector = TcpConnector(host=host, announce=direct_announce, bind_host=direct_host,
                             connect_timeout_s=connect_timeout_s)
    relay = StarBus(AiohttpSocket(heartbeat_s=heartbeat_s), url, token=token, trainer_token=trainer_token,
                    reconnect_max_s=reconnect_max_s, max_message_bytes=kw.get("relay_max_message_bytes",
                                                                               DATA_CHANNEL_MAX_MESSAGE_BYTES),
                    precision=kw.get("precision", "f32"), int8_block=kw.get("int8_block", DEFAULT_INT8_BLOCK),
                    use_numpy=kw.get("use_numpy"))
    kw.setdefault("relay_while_connecting", True)
    return MeshBus(relay, connector, connect_timeout_s=connect_timeout_s, **kw)
