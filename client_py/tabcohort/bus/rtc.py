"""WebRTC mesh bus: one aiortc RTCPeerConnection and one data channel (ordered, reliable,
binary) per pair of ranks, negotiated through the server over the rank's WebSocket; a pair whose
channel does not come up within ``connect_timeout_s`` (or fails, or goes idle) uses the server
relay for that pair instead.

Native only; aiortc is imported inside :meth:`RtcMeshBus.connect`.

Signalling (JSON controls on the rank WebSocket, forwarded by the server by recipient id within
the room, ``from`` bound to the link): ``{"type": "signal", "to": id, "kind": "offer"|"answer",
"sdp": ...}`` and ``{"type": "signal", "to": id, "kind": "candidate", "candidate": {candidate,
sdpMid, sdpMLineIndex}}`` (trickled by browsers; aiortc gathers before the offer completes and
needs none). The lower id offers. ``{"type": "relay_peers", "ids": [...]}`` tells the server which
peers this rank reaches through the relay: in a mesh room a broadcast chunk is relayed only to
those.

Per link: a send queue drained into the channel while its ``bufferedAmount`` is below
``channel_high_water_bytes`` and refilled on ``bufferedamountlow`` (aiortc's ``send`` never refuses
data, so without this a fast leader queues without bound). ``pressure()`` is the max over links of
(queued + bufferedAmount) / ``high_water_bytes``, and the relay's pressure. ``bytes()`` counts
chunk bytes per peer over whichever path carried them; :meth:`transport_bytes` splits them by
path (``rtc`` / ``relay``), so a silent fallback is visible.

Chunks are cut at the negotiated max message size of the links they go on (the remote's
``a=max-message-size``, none -> 64 KiB; aiortc and Chromium advertise 256 KiB).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Callable, Sequence

from ..errors import ConfigError
from ..wire import DATA_CHANNEL_MAX_MESSAGE_BYTES, DEFAULT_MAX_MESSAGE_BYTES, FrameReader, FrameWriter, parse_route
from ..wire.codecs import DEFAULT_INT8_BLOCK
from .base import LinkBytes
from .rtc_util import (CHANNEL_LABEL, add_candidate, configuration, gate_receive, negotiated_max_message_bytes,
                       parse_ice_servers, set_host_addresses)
from .ws import WsBus

log = logging.getLogger("tabcohort.bus.rtc")

DEFAULT_HIGH_WATER_BYTES = 1 << 20
DEFAULT_CONNECT_TIMEOUT_S = 5.0
#: Per-link send queue bound; beyond it posts to that peer are dropped (``send_overflow``).
DEFAULT_MAX_QUEUE_BYTES = 64 << 20
#: Frames of one chunk up to this size go ahead of queued bulk chunks on a link.
URGENT_MAX_BYTES = 2048


class _Link:
    """One pair: its peer connection, channel, send queue, path and counters."""

    def __init__(self, peer: int, now: float) -> None:
        self.peer = peer
        self.kind = "connecting"        # connecting | rtc | relay
        self.created = now
        self.last_rx = now
        self.pc: Any = None
        self.channel: Any = None
        self.queue: deque[bytes] = deque()
        self.n_urgent = 0               # small frames at the front of the queue (see post)
        self.queued_bytes = 0
        self.max_message_bytes = DEFAULT_MAX_MESSAGE_BYTES
        self.why: str | None = None     # why it is on the relay
        self.sent = 0
        self.received = 0
        self.rtc_sent = 0
        self.rtc_received = 0
        self.up_after_s: float | None = None
        #: bytes of ours the peer took off the channel but holds unconsumed (its ``backlog``
        #: signal: a tab's page cannot pause reading a data channel); counted as buffered
        self.remote_backlog = 0
        self.held_bytes = 0             # ours of the peer's, held while stalled (what we report)
        self.backlog_sent = 0

    def buffered(self) -> int:
        ch = self.channel
        return self.queued_bytes + (ch.bufferedAmount if ch is not None else 0) + self.remote_backlog


class RtcMeshBus:
    """One rank's bus over a WebRTC mesh (the bus contract, PROTOCOL.md).

    Args:
        ws_url: the room's rank WebSocket (signalling and relay fallback).
        ice_servers: STUN/TURN URLs (``turn:user:pass@host:port``); none by default.
        host_addresses: ICE host candidate addresses (e.g. ``["127.0.0.1"]`` on a loopback-only
            host); ``None`` = aioice's own list. Process-wide (see ``rtc_util``).
        connect_timeout_s: a pair whose channel is not open after this long uses the relay.
        idle_timeout_s: an open channel with no bytes from the peer for this long is declared
            dead and the pair moves to the relay (``None`` = off; the protocol beats every
            ``policy.beat``, so a few seconds is plenty while a rank runs).
        high_water_bytes: queued + buffered bytes per link at which ``pressure()`` reaches 1.
        channel_high_water_bytes / channel_low_water_bytes: flow control on ``bufferedAmount``.
    """

    def __init__(self, ws_url: str, *, token: str | None = None, precision: str = "f32",
                 ice_servers: Sequence[str] | str | None = None, host_addresses: Sequence[str] | None = None,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S, idle_timeout_s: float | None = 10.0,
                 high_water_bytes: int = DEFAULT_HIGH_WATER_BYTES, channel_high_water_bytes: int = 1 << 20,
                 channel_low_water_bytes: int = 256 << 10, max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
                 int8_block: int = DEFAULT_INT8_BLOCK, use_numpy: bool | None = None,
                 on_control: Callable[[dict], None] | None = None, **ws_kwargs: Any) -> None:
        if not isinstance(high_water_bytes, int) or high_water_bytes < 1:
            raise ConfigError("high_water_bytes", high_water_bytes, "must be a positive int")
        if not (isinstance(connect_timeout_s, (int, float)) and connect_timeout_s > 0):
            raise ConfigError("connect_timeout_s", connect_timeout_s, "must be a positive number of seconds")
        self.ice_servers = parse_ice_servers(ice_servers)
        self.host_addresses = None if host_addresses is None else list(host_addresses)
        if self.host_addresses is not None:
            set_host_addresses(self.host_addresses)
        FrameWriter(0, precision=precision, int8_block=int8_block)
        self.precision = precision
        self.int8_block = int8_block
        self.use_numpy = use_numpy
        self.connect_timeout_s = float(connect_timeout_s)
        self.idle_timeout_s = idle_timeout_s
        self.high_water_bytes = high_water_bytes
        self.channel_high_water_bytes = channel_high_water_bytes
        self.channel_low_water_bytes = channel_low_water_bytes
        self.max_queue_bytes = max_queue_bytes
        self.on_control = on_control
        self.on_message: Callable[[dict], None] | None = None
        self.ws = self._relay_link(ws_url, token=token, precision=precision, int8_block=int8_block,
                                   use_numpy=use_numpy, on_control=self._on_control, **ws_kwargs)
        self.ws.on_chunk = self._on_relay_chunk
        self.id = 0
        self.writer: FrameWriter | None = None
        self.reader = FrameReader(None, use_numpy=use_numpy)
        self.links_: dict[int, _Link] = {}
        self.closed = False
        self._drops: dict[str, int] = {}
        self._relay_declared: set[int] = set()
        self._tasks: set[asyncio.Task] = set()
        self._supervisor: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stall_gate: asyncio.Event | None = None
        self._held: list[tuple[_Link, bytes, str]] = []
        self.fallbacks: list[tuple[int, str]] = []   # (peer, why), for logs and tests

    # ------------------------------------------------------------------ peer-connection backend
    # The link state machine below (connecting -> rtc | relay, flow control, byte accounting,
    # relay fallback) is shared; these hooks are the peer-connection backend. Natively it is
    # aiortc; in a browser tab the page's RTCPeerConnection (tabcohort.bus.browser.BrowserMeshBus
    # overrides the hooks: _relay_link, _check_backend, _offer, _answer, _accept, _add_candidate,
    # _drain, _close_pc, _gate_links).
    def _relay_link(self, ws_url: str, **kw: Any) -> Any:
        """The rank's WebSocket to the server: signalling, controls, and the relay fallback."""
        return WsBus(ws_url, **kw)

    def _check_backend(self) -> None:
        import aiortc  # noqa: F401  (fail here, before any network activity, if missing)

    def _gate_links(self, links: list) -> None:
        """Make the links' receive paths wait on the stall gate (tests: a black-holed consumer)."""
        for lk in links:
            gate_receive(lk.pc, self._stall_gate)

    def _add_candidate(self, lk: _Link, candidate: dict) -> None:
        self._spawn(add_candidate(lk.pc, candidate))

    # ------------------------------------------------------------------ lifecycle
    async def connect(self, timeout_s: float = 10.0) -> "RtcMeshBus":
        """Join the room's WebSocket (id, peers), then open a channel to every peer.

        Raises:
            LinkFailed: the server refused or did not answer.
        """
        self._check_backend()
        await self.ws.connect(timeout_s)
        self.id = self.ws.id
        self.writer = FrameWriter(self.id, precision=self.precision, max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES,
                                  int8_block=self.int8_block, use_numpy=self.use_numpy)
        self._loop = asyncio.get_running_loop()
        self._stall_gate = asyncio.Event()
        self._stall_gate.set()
        for p in sorted(self.ws.peers):
            self._ensure_link(p)
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())
        return self

    @property
    def peers(self) -> set[int]:
        return set(self.links_)

    @property
    def failed(self) -> str | None:
        return self.ws.failed

    @property
    def connected(self) -> bool:
        return self.ws.connected

    @property
    def secret(self) -> str | None:
        return self.ws.secret

    @property
    def stopped_reason(self) -> str | None:
        return self.ws.stopped_reason

    def send_control(self, obj: dict) -> None:
        self.ws.send_control(obj)

    def queued_bytes(self) -> int:
        return self.ws.queued_bytes() + sum(lk.queued_bytes for lk in self.links_.values())

    def close(self) -> None:
        """Stop delivery both ways (idempotent). :meth:`aclose` also waits for the teardown."""
        if self.closed:
            return
        self.closed = True
        self.on_message = None
        if self._supervisor is not None:
            self._supervisor.cancel()
        for lk in list(self.links_.values()):
            self._close_pc(lk)
        self.ws.close()

    async def aclose(self) -> None:
        self.close()
        await self.ws.aclose()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5.0)

    # ------------------------------------------------------------------ the bus contract
    def post(self, msg: dict) -> None:
        """Encode ``msg`` once and put it on each target's link (all peers, or ``msg["to"]``).

        Raises:
            LocalProtocolError: the message cannot be encoded.
        """
        if self.closed or self.writer is None:
            return
        to = msg.get("to")
        if to is not None:
            lk = self.links_.get(to)
            targets = [lk] if lk is not None else []
            if lk is None and to != self.id:
                self.writer.write(msg)  # still validate and encode, as the other buses do
                self._count("no_route")
                return
        else:
            targets = list(self.links_.values())
        rtc_sizes = [lk.max_message_bytes for lk in targets if lk.kind != "relay"]
        self.writer.max_message_bytes = min(rtc_sizes, default=DATA_CHANNEL_MAX_MESSAGE_BYTES)
        chunks = self.writer.write(msg)
        size = sum(map(len, chunks))
        # A one-chunk frame of at most URGENT_MAX_BYTES (a beat, a hello, a small model's bucket)
        # overtakes queued chunks of large frames: an ordered channel would otherwise hold a
        # heartbeat behind megabytes of parameters for longer than policy.drop (measured: a
        # 2-rank mesh at 1M parameters flapped between cohort 1 and 2). The reader reassembles
        # per frame, and the protocol does not rely on order between frames (PROTOCOL.md).
        urgent = len(chunks) == 1 and size <= URGENT_MAX_BYTES
        relay: list[_Link] = []
        for lk in targets:
            if lk.kind == "relay":
                relay.append(lk)
                continue
            if lk.queued_bytes + size > self.max_queue_bytes:
                self._count("send_overflow")
                continue
            if urgent:   # ahead of queued bulk chunks, behind earlier small frames
                lk.queue.insert(lk.n_urgent, chunks[0])
                lk.n_urgent += 1
            else:
                lk.queue.extend(chunks)
            lk.queued_bytes += size
            lk.sent += size
            if lk.kind == "rtc":
                lk.rtc_sent += size
                self._drain(lk)
        if relay and self.ws.send_raw(chunks):
            for lk in relay:
                lk.sent += size

    def bytes(self) -> dict[int, LinkBytes]:
        return {p: LinkBytes(lk.sent, lk.received) for p, lk in sorted(self.links_.items())
                if lk.sent or lk.received}

    def total_bytes(self) -> int:
        return sum(lk.sent + lk.received for lk in self.links_.values())

    def transport_bytes(self) -> dict[str, int]:
        """Bytes (sent + received) carried by data channels (``rtc``) and by the relay."""
        rtc = sum(lk.rtc_sent + lk.rtc_received for lk in self.links_.values())
        return {"rtc": rtc, "relay": self.total_bytes() - rtc}

    def links(self) -> dict[int, str]:
        """Each peer's path: ``rtc``, ``relay`` or ``connecting`` (not yet up, within the bound)."""
        return {p: lk.kind for p, lk in sorted(self.links_.items())}

    def pressure(self) -> float:
        worst = max((lk.buffered() for lk in self.links_.values()), default=0)
        return max(worst / self.high_water_bytes, self.ws.pressure())

    def quantize(self, params: Any) -> Any:
        w = self.writer or FrameWriter(0, precision=self.precision, int8_block=self.int8_block,
                                       use_numpy=self.use_numpy)
        return w.quantize(params)

    def drops(self) -> dict[str, int]:
        out = dict(self.reader.drops)
        for src in (self._drops, self.ws.drops()):
            for k, v in src.items():
                out[k] = out.get(k, 0) + v
        return out

    def stall(self, stalled: bool) -> None:
        """Tests: stop (True) / resume (False) taking data off every link (held, not lost)."""
        if stalled:
            self._stall_gate.clear()
        else:
            self._stall_gate.set()
            held, self._held = self._held, []
            for lk, chunk, path in held:
                self._deliver(lk, chunk, path)
        self._gate_links([lk for lk in self.links_.values() if lk.pc is not None and lk.kind == "rtc"])
        self.ws.stall(stalled)

    def _count(self, reason: str, n: int = 1) -> None:
        self._drops[reason] = self._drops.get(reason, 0) + n

    # ------------------------------------------------------------------ links
    def _spawn(self, coro: Any) -> None:
        t = self._loop.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._task_done)

    def _task_done(self, t: asyncio.Task) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and t.exception() is not None and not self.closed:
            log.warning("rank %08x: link task failed: %r", self.id, t.exception())

    def _ensure_link(self, peer: int) -> _Link:
        lk = self.links_.get(peer)
        if lk is None:
            lk = self.links_[peer] = _Link(peer, self._loop.time())
            if self.id < peer:
                self._spawn(self._offer(lk))
        return lk

    def _new_pc(self, lk: _Link) -> Any:
        from aiortc import RTCPeerConnection

        pc = RTCPeerConnection(configuration(self.ice_servers))
        lk.pc = pc

        @pc.on("connectionstatechange")
        def _state() -> None:
            if pc is lk.pc and pc.connectionState in ("failed", "closed") and lk.kind != "relay":
                self._fallback(lk, f"peer connection {pc.connectionState}")

        @pc.on("datachannel")
        def _channel(ch: Any) -> None:
            self._setup_channel(lk, ch)
        return pc

    def _setup_channel(self, lk: _Link, ch: Any) -> None:
        if lk.kind == "relay" or lk.pc is None:
            ch.close()
            return
        lk.channel = ch
        ch.bufferedAmountLowThreshold = self.channel_low_water_bytes

        def opened() -> None:
            if lk.channel is ch:
                self._channel_opened(lk, negotiated_max_message_bytes(lk.pc))

        @ch.on("message")
        def _message(data: Any) -> None:
            if isinstance(data, (bytes, bytearray)) and lk.channel is ch:
                self._on_rtc_chunk(lk, bytes(data))

        @ch.on("bufferedamountlow")
        def _low() -> None:
            self._drain(lk)

        @ch.on("close")
        def _closed() -> None:
            if lk.channel is ch and lk.kind != "relay" and not self.closed:
                self._fallback(lk, "data channel closed")

        if ch.readyState == "open":
            opened()
        else:
            ch.on("open", opened)

    def _channel_opened(self, lk: _Link, max_message_bytes: int) -> None:
        """The pair's data channel is open: the link carries chunks from now on."""
        if lk.kind != "connecting":
            return
        lk.kind = "rtc"
        lk.max_message_bytes = max_message_bytes
        now = self._loop.time()
        lk.last_rx = now
        lk.up_after_s = now - lk.created
        # anything queued while connecting was cut for the smallest size; re-count as rtc
        lk.rtc_sent += lk.queued_bytes
        if any(len(c) > lk.max_message_bytes for c in lk.queue):
            self._count("link_down", len(lk.queue))
            lk.sent -= lk.queued_bytes
            lk.rtc_sent -= lk.queued_bytes
            lk.queue.clear()
            lk.n_urgent = 0
            lk.queued_bytes = 0
        if self._stall_gate is not None and not self._stall_gate.is_set():
            self._gate_links([lk])
        log.info("rank %08x: data channel to %08x open after %.2f s (max message %d)",
                 self.id, lk.peer, lk.up_after_s, lk.max_message_bytes)
        self._drain(lk)

    async def _offer(self, lk: _Link) -> None:
        pc = self._new_pc(lk)
        ch = pc.createDataChannel(CHANNEL_LABEL, ordered=True)
        self._setup_channel(lk, ch)
        await pc.setLocalDescription(await pc.createOffer())
        if lk.pc is pc:
            self.ws.send_control({"type": "signal", "to": lk.peer, "kind": "offer",
                                  "sdp": pc.localDescription.sdp})

    async def _answer(self, lk: _Link, sdp: str) -> None:
        from aiortc import RTCSessionDescription

        if lk.pc is not None:
            self._close_pc(lk)
        pc = self._new_pc(lk)
        await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
        await pc.setLocalDescription(await pc.createAnswer())
        if lk.pc is pc:
            self.ws.send_control({"type": "signal", "to": lk.peer, "kind": "answer",
                                  "sdp": pc.localDescription.sdp})

    async def _accept(self, lk: _Link, sdp: str) -> None:
        from aiortc import RTCSessionDescription

        if lk.pc is not None and lk.pc.signalingState == "have-local-offer":
            await lk.pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="answer"))

    def _on_signal(self, obj: dict) -> None:
        frm, kind = obj.get("from"), obj.get("kind")
        if not isinstance(frm, int) or frm == self.id or self.closed:
            return
        lk = self._ensure_link(frm)
        if kind == "backlog":
            n = obj.get("bytes")
            if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
                lk.remote_backlog = min(n, self.max_queue_bytes)
            else:
                self._count("bad_signal")
            return
        if lk.kind == "relay":
            return
        if kind == "offer" and isinstance(obj.get("sdp"), str) and frm < self.id:
            self._spawn(self._answer(lk, obj["sdp"]))
        elif kind == "answer" and isinstance(obj.get("sdp"), str):
            self._spawn(self._accept(lk, obj["sdp"]))
        elif kind == "candidate" and isinstance(obj.get("candidate"), dict) and lk.pc is not None:
            self._add_candidate(lk, obj["candidate"])
        elif kind == "bye":
            self._fallback(lk, "peer gave up on the channel")
        else:
            self._count("bad_signal")

    def _drain(self, lk: _Link) -> None:
        ch = lk.channel
        if ch is None or lk.kind != "rtc" or ch.readyState != "open":
            return
        if asyncio._get_running_loop() is not self._loop:
            # called outside the loop (a synchronous caller between loop runs): aiortc schedules
            # its flush on the running loop, so send from inside it
            self._loop.call_soon(self._drain, lk)
            return
        while lk.queue and ch.bufferedAmount < self.channel_high_water_bytes:
            c = lk.queue.popleft()
            lk.n_urgent = max(0, lk.n_urgent - 1)
            lk.queued_bytes -= len(c)
            ch.send(c)

    def _fallback(self, lk: _Link, why: str) -> None:
        """Move one pair to the server relay (for good: the channel is not retried)."""
        if lk.kind == "relay" or self.closed:
            return
        lk.kind = "relay"
        lk.why = why
        self.fallbacks.append((lk.peer, why))
        if lk.queue:
            self._count("link_down", len(lk.queue))
            lk.sent -= lk.queued_bytes
            lk.rtc_sent = min(lk.rtc_sent, lk.sent)
        lk.queue.clear()
        lk.n_urgent = 0
        lk.queued_bytes = 0
        log.warning("rank %08x: link to %08x uses the relay: %s", self.id, lk.peer, why)
        self.ws.send_control({"type": "signal", "to": lk.peer, "kind": "bye"})
        self._close_pc(lk)
        self._declare_relay()

    def _declare_relay(self) -> None:
        ids = {p for p, lk in self.links_.items() if lk.kind == "relay"}
        if ids != self._relay_declared:
            self._relay_declared = ids
            self.ws.send_control({"type": "relay_peers", "ids": sorted(ids)})

    def _close_pc(self, lk: _Link) -> None:
        pc, lk.pc, lk.channel = lk.pc, None, None
        if pc is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._spawn(pc.close())

    def _drop_link(self, peer: int) -> None:
        lk = self.links_.pop(peer, None)
        if lk is not None:
            self._close_pc(lk)
            if lk.kind == "relay":
                self._declare_relay()

    async def _supervise(self) -> None:
        """Once per 0.25 s: bound the connect time, and detect idle (vanished) peers."""
        loop = asyncio.get_running_loop()
        while not self.closed:
            await asyncio.sleep(0.25)
            now = loop.time()
            for lk in list(self.links_.values()):
                if lk.kind == "connecting" and now - lk.created > self.connect_timeout_s:
                    self._fallback(lk, f"channel not open within {self.connect_timeout_s:g} s")
                elif (lk.kind == "rtc" and self.idle_timeout_s and now - lk.last_rx > self.idle_timeout_s
                      and self._stall_gate.is_set()):
                    self._fallback(lk, f"no bytes from the peer for {self.idle_timeout_s:g} s")

    # ------------------------------------------------------------------ inbound
    def _on_rtc_chunk(self, lk: _Link, chunk: bytes) -> None:
        lk.last_rx = self._loop.time()
        if not self._stall_gate.is_set():
            self._held.append((lk, chunk, "rtc"))
            return
        self._deliver(lk, chunk, "rtc")

    def _on_relay_chunk(self, chunk: bytes) -> None:
        try:
            sender = parse_route(chunk).sender
        except Exception:
            sender = 0
        lk = self.links_.get(sender)
        if lk is None:
            self._count("unknown_sender")
            return
        self._deliver(lk, chunk, "relay")

    def _deliver(self, lk: _Link, chunk: bytes, path: str) -> None:
        if self.closed:
            return
        lk.received += len(chunk)
        if path == "rtc":
            lk.rtc_received += len(chunk)
        for m in self.reader.feed(chunk, now_ms=self._loop.time() * 1000.0):
            cb = self.on_message
            if cb is not None and not self.closed:
                cb(m)

    def _on_control(self, obj: dict) -> None:
        t = obj.get("type")
        if self.closed:
            return
        if t == "peer":
            k = obj.get("id")
            if isinstance(k, int) and k != self.id:
                if obj.get("up"):
                    if k in self.links_ and self.links_[k].kind == "relay":
                        self._drop_link(k)  # a reconnected peer gets a fresh try
                    self._ensure_link(k)
                else:
                    self._drop_link(k)
        elif t == "signal":
            self._on_signal(obj)
        elif t == "welcome" and self.writer is not None:
            # a resumed socket: the server forgot what we relay through it
            self._relay_declared = set()
            self._declare_relay()
        if self.on_control is not None and t not in ("signal",):
            self.on_control(obj)


class RtcStarBus(WsBus):
    """The star topology over WebRTC: this rank's one link to the server is a data channel
    (``--link rtc``), negotiated over the rank WebSocket, which keeps carrying the controls.

    If the channel is not open within ``connect_timeout_s`` (or closes later) chunks go on the
    WebSocket instead; :meth:`links` says which (``{0: "rtc"|"ws"}``, 0 = the server) and
    :meth:`transport_bytes` how many bytes each carried. Flow control as in :class:`RtcMeshBus`:
    the send loop waits while the channel's ``bufferedAmount`` is above the high-water mark, so
    chunks stay in this bus's queue and ``pressure()`` sees them.
    """

    def __init__(self, ws_url: str, *, ice_servers: Sequence[str] | str | None = None,
                 host_addresses: Sequence[str] | None = None,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 channel_high_water_bytes: int = 1 << 20, channel_low_water_bytes: int = 256 << 10,
                 **kw: Any) -> None:
        super().__init__(ws_url, **kw)
        self.ice_servers = parse_ice_servers(ice_servers)
        if host_addresses is not None:
            set_host_addresses(list(host_addresses))
        self.connect_timeout_s = float(connect_timeout_s)
        self.channel_high_water_bytes = channel_high_water_bytes
        self.channel_low_water_bytes = channel_low_water_bytes
        self.pc: Any = None
        self.channel: Any = None
        self.rtc_up = False
        self.rtc_why: str | None = None
        self.rtc_sent = 0
        self.rtc_received = 0
        self._low: asyncio.Event | None = None
        self._held: list[bytes] = []
        self.chunk_bytes_in = 0      # chunk bytes taken off either path
        self.ws_chunk_bytes_out = 0  # chunk bytes put on the WebSocket (channel not up)
        self._rtc_tasks: set[asyncio.Task] = set()

    async def connect(self, timeout_s: float = 10.0) -> "RtcStarBus":
        """Register on the WebSocket, then open the data channel to the server (bounded).

        Raises:
            LinkFailed: the server refused or did not answer (the channel failing is not fatal).
        """
        import aiortc  # noqa: F401

        await super().connect(timeout_s)
        self._low = asyncio.Event()
        try:
            await asyncio.wait_for(self._open_rtc(), self.connect_timeout_s)
        except asyncio.TimeoutError:
            self._rtc_down(f"channel to the server not open within {self.connect_timeout_s:g} s")
        return self

    async def _open_rtc(self) -> None:
        from aiortc import RTCPeerConnection

        pc = self.pc = RTCPeerConnection(configuration(self.ice_servers))
        ch = self.channel = pc.createDataChannel(CHANNEL_LABEL, ordered=True)
        ch.bufferedAmountLowThreshold = self.channel_low_water_bytes
        opened = asyncio.Event()
        ch.on("open", opened.set)

        @ch.on("message")
        def _message(data: Any) -> None:
            if isinstance(data, (bytes, bytearray)) and not self.closed:
                self.rtc_received += len(data)
                if self._recv_gate is not None and not self._recv_gate.is_set():
                    self._held.append(bytes(data))
                else:
                    self._on_chunk(bytes(data))

        ch.on("bufferedamountlow", self._low.set)
        ch.on("close", lambda: self._rtc_down("data channel closed"))

        @pc.on("connectionstatechange")
        def _state() -> None:
            if pc.connectionState in ("failed", "closed"):
                self._rtc_down(f"peer connection {pc.connectionState}")

        await pc.setLocalDescription(await pc.createOffer())
        self.send_control({"type": "signal", "to": 0, "kind": "offer", "sdp": pc.localDescription.sdp})
        await opened.wait()
        self.rtc_up = True
        self.writer.max_message_bytes = negotiated_max_message_bytes(pc)
        log.info("rank %08x: WebRTC star link open (max message %d)", self.id, self.writer.max_message_bytes)

    def _rtc_down(self, why: str) -> None:
        if self.rtc_why is None and not self.closed:
            self.rtc_why = why
            log.warning("rank %08x: star link uses the WebSocket: %s", self.id, why)
        self.rtc_up = False
        if self._low is not None:
            self._low.set()

    def _handle_control(self, obj: dict) -> None:
        if obj.get("type") == "signal" and obj.get("from") == 0 and obj.get("kind") == "answer" \
                and self.pc is not None and isinstance(obj.get("sdp"), str):
            from aiortc import RTCSessionDescription

            t = asyncio.get_running_loop().create_task(
                self.pc.setRemoteDescription(RTCSessionDescription(sdp=obj["sdp"], type="answer")))
            self._rtc_tasks.add(t)
            t.add_done_callback(self._rtc_tasks.discard)
            return
        super()._handle_control(obj)

    async def _send_chunk(self, ws: Any, chunk: bytes) -> None:
        ch = self.channel
        while self.rtc_up and ch.bufferedAmount >= self.channel_high_water_bytes:
            self._low.clear()
            try:
                await asyncio.wait_for(self._low.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        # a chunk cut before the channel opened may exceed what it takes: the WebSocket carries it
        if self.rtc_up and ch.readyState == "open" and len(chunk) <= self.writer.max_message_bytes:
            ch.send(chunk)
            self.rtc_sent += len(chunk)
        else:
            await ws.send_bytes(chunk)
            self.ws_chunk_bytes_out += len(chunk)

    def _on_chunk(self, chunk: bytes) -> None:
        self.chunk_bytes_in += len(chunk)
        super()._on_chunk(chunk)

    def links(self) -> dict[int, str]:
        return {0: "rtc" if self.rtc_up else "ws"}

    def transport_bytes(self) -> dict[str, int]:
        """Chunk bytes this rank's link carried (up + down) on the channel and on the WebSocket."""
        return {"rtc": self.rtc_sent + self.rtc_received,
                "ws": self.ws_chunk_bytes_out + self.chunk_bytes_in - self.rtc_received}

    def stall(self, stalled: bool) -> None:
        super().stall(stalled)
        if self.pc is not None and self.rtc_up:
            if stalled:
                self._gate = getattr(self, "_gate", None) or asyncio.Event()
                self._gate.clear()
                gate_receive(self.pc, self._gate)
            elif getattr(self, "_gate", None) is not None:
                self._gate.set()
        if not stalled:
            held, self._held = self._held, []
            for c in held:
                self._on_chunk(c)

    async def _teardown(self) -> None:
        await super()._teardown()
        pc, self.pc = self.pc, None
        if pc is not None:
            await pc.close()
