"""Browser bus (Pyodide in a dedicated Web Worker): the WebSocket star link, owned by the page.

A Web Worker cannot hold the page's RTCPeerConnections, and the page owns the sockets so that a
UI can show them; the rank's Python runs in the worker. The two talk with ``postMessage``:

- worker -> page: ``{k: "ws-open", link, url}``, ``{k: "send", link, data: [ArrayBuffer...]}``
  (the chunks of one frame, transferred, not copied), ``{k: "send-text", link, text}``,
  ``{k: "ws-close", link}``;
- page -> worker: ``{k: "ws-opened", link}``, ``{k: "ws-chunk", link, data: ArrayBuffer}``
  (transferred), ``{k: "ws-text", link, text}``, ``{k: "ws-closed", link, code, reason}``,
  ``{k: "ack", link, bytes, buffered}`` (after each send: bytes handed to the socket, and its
  ``bufferedAmount``; repeated while ``bufferedAmount`` drains), anything else to the hub's
  ``on_other`` (UI controls).

The worker's ``onmessage`` (``web/rank-worker.js``) only appends to an inbox and calls one
Python wake-up; :class:`PortHub` drains the whole inbox per wake-up (an await of a JS promise
costs 150-270 us in Pyodide, so never one await per message).

:class:`BrowserBus` speaks the same relay protocol as :class:`tabcohort.bus.ws.WsBus`
(``register``/``welcome``/``peer``/``pressure``/``stop`` controls, resume with id and secret on
reconnect) with the same chunking (:class:`~tabcohort.wire.FrameWriter`, 64 KiB), byte
accounting (per peer id, chunk headers included; a broadcast counts once per known peer) and
flow control (``pressure()`` = max(bytes not yet on the wire / high water, relay pressure);
posts beyond ``max_queue_bytes`` are dropped as ``send_overflow``).

``js`` and ``pyodide.ffi`` are imported lazily (inside :class:`JsPort`), so this module imports
natively too; tests can pass any port with the same four methods.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections import deque
from typing import Any, Callable

from ..errors import ConfigError, RemoteProtocolError, TabcohortError
from ..wire import DEFAULT_MAX_MESSAGE_BYTES, FrameReader, FrameWriter, WireLimits, parse_route
from ..wire.codecs import DEFAULT_INT8_BLOCK
from .base import LinkBytes
from .rtc import RtcMeshBus
from .rtc_util import ice_server_dicts
from .backoff import full_jitter_s
from .ws import (_FATAL_CLOSE, CLOSE_RETRY_LATER, CLOSE_UNKNOWN_ID, DEFAULT_HIGH_WATER_BYTES,
                 DEFAULT_MAX_QUEUE_BYTES, LinkFailed)

log = logging.getLogger("tabcohort.bus.browser")

TRANSPORT = "ws-star"


class JsPort:
    """The worker side of the page link (``web/rank-worker.js`` defines the ``tc*`` globals)."""

    def __init__(self) -> None:
        import js  # noqa: F401  (Pyodide only)
        from pyodide.ffi import create_proxy, to_js

        self._js = js
        self._to_js = to_js
        self._proxies: list[Any] = []
        self._create_proxy = create_proxy
        self.proxies_created = 0
        self.proxies_destroyed = 0

    def proxy(self, fn: Callable) -> Any:
        """A JS-callable proxy of ``fn``; destroyed by :meth:`destroy`."""
        p = self._create_proxy(fn)
        self._proxies.append(p)
        self.proxies_created += 1
        return p

    def set_wake(self, fn: Callable[[], None] | None) -> None:
        self._js.tcSetWake(self.proxy(fn) if fn is not None else None)

    def take(self) -> list[dict]:
        """Every queued page message, converted to Python (ArrayBuffers become bytes)."""
        # JsProxies of plain JS objects need no destroy (only create_proxy results do).
        items = self._js.tcTakeInbox()
        out = []
        for i in range(items.length):
            it = items[i]
            d: dict[str, Any] = {"k": it.k}
            for key in ("link", "code", "bytes", "buffered", "text", "reason", "action", "value", "url",
                        "peer", "gen"):
                v = getattr(it, key, None)
                if v is not None:
                    d[key] = v
            data = getattr(it, "data", None)
            if data is not None:
                d["data"] = data.to_bytes()
            out.append(d)
        return out

    def open(self, link: int, url: str) -> None:
        self._js.tcPost(self._to_js({"k": "ws-open", "link": link, "url": url},
                                    dict_converter=self._js.Object.fromEntries))

    def send_chunks(self, link: int, chunks: list[bytes]) -> None:
        self._js.tcSendChunks(link, self._to_js(chunks))

    def send_text(self, link: int, text: str) -> None:
        self._js.tcSendText(link, text)

    def close(self, link: int) -> None:
        self._js.tcPost(self._to_js({"k": "ws-close", "link": link}, dict_converter=self._js.Object.fromEntries))

    def rtc(self, obj: dict) -> None:
        """A WebRTC control to the page (``rtc-open``, ``rtc-signal``, ``rtc-close``), as JSON."""
        self._js.tcPostJsonTo(json.dumps(obj, separators=(",", ":")))

    def rtc_send(self, link: int, peer: int, gen: int, chunks: list[bytes]) -> None:
        """Chunks for one data channel, transferred (not copied) to the page."""
        self._js.tcRtcSend(link, peer, gen, self._to_js(chunks))

    def post_json(self, obj: dict) -> None:
        """A JSON message to the page's UI (``{k: ..., ...}``)."""
        self._js.tcPostJson(json.dumps(obj, separators=(",", ":"), default=str))

    def destroy(self) -> None:
        try:
            self._js.tcSetWake(None)
        except Exception:  # pragma: no cover - the worker is going away
            pass
        for p in self._proxies:
            p.destroy()
            self.proxies_destroyed += 1
        self._proxies.clear()


class PortHub:
    """Drains the page's messages once per wake-up and dispatches them by link id.

    Args:
        port: a :class:`JsPort` (or a fake with ``set_wake``, ``take``, ``open``,
            ``send_chunks``, ``send_text``, ``close``).
        on_other: called with every message that is not for a link (UI controls).
    """

    def __init__(self, port: Any, on_other: Callable[[dict], None] | None = None) -> None:
        self.port = port
        self.on_other = on_other
        self.links: dict[int, "BrowserBus"] = {}
        self._next_link = 1
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.n_wakeups = 0
        self.n_items = 0

    def start(self) -> "PortHub":
        self.port.set_wake(self._wake.set)
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def new_link(self, bus: "BrowserBus") -> int:
        k = self._next_link
        self._next_link += 1
        self.links[k] = bus
        return k

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            items = self.port.take()
            self.n_wakeups += 1
            self.n_items += len(items)
            for it in items:
                bus = self.links.get(it.get("link")) if "link" in it else None
                try:
                    if bus is not None:
                        bus._on_port(it)
                    elif "link" not in it and self.on_other is not None:
                        self.on_other(it)
                except Exception:
                    log.exception("handling page message %r failed", it.get("k"))

    async def aclose(self) -> None:
        for bus in list(self.links.values()):
            bus.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.port.set_wake(None)


class BrowserBus:
    """One rank's bus over the server's star relay, through the page's WebSocket.

    Args:
        hub: the :class:`PortHub` of this worker.
        ws_url: absolute ``ws(s)://host:port/api/rooms/{room}/ws``.
        token, precision, max_message_bytes, high_water_bytes, int8_block, limits, use_numpy,
        reconnect_max_s, max_queue_bytes, on_control: as for :class:`~tabcohort.bus.ws.WsBus`.
    """

    transport = TRANSPORT

    def __init__(self, hub: PortHub, ws_url: str, *, token: str | None = None, precision: str = "f32",
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 high_water_bytes: int = DEFAULT_HIGH_WATER_BYTES, int8_block: int = DEFAULT_INT8_BLOCK,
                 limits: WireLimits | None = None, use_numpy: bool | None = None,
                 reconnect_max_s: float = 30.0, max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
                 on_control: Callable[[dict], None] | None = None) -> None:
        if not isinstance(high_water_bytes, int) or high_water_bytes < 1:
            raise ConfigError("high_water_bytes", high_water_bytes, "must be a positive int")
        FrameWriter(0, precision=precision, max_message_bytes=max_message_bytes, int8_block=int8_block)
        self.hub = hub
        self.link = hub.new_link(self)
        self.ws_url = ws_url
        self.token = token
        self.precision = precision
        self.max_message_bytes = max_message_bytes
        self.int8_block = int8_block
        self.use_numpy = use_numpy
        self.high_water_bytes = high_water_bytes
        self.reconnect_max_s = reconnect_max_s
        self.max_queue_bytes = max_queue_bytes
        self.on_control = on_control
        self.on_message: Callable[[dict], None] | None = None
        #: when set (by :class:`BrowserMeshBus`), inbound chunks go here undecoded
        self.on_chunk: Callable[[bytes], None] | None = None
        self.id = 0
        self.secret: str | None = None
        self.writer: FrameWriter | None = None
        self.reader = FrameReader(limits, use_numpy=use_numpy)
        self.peers: set[int] = set()
        self.closed = False
        self.failed: str | None = None
        self.connected = False
        self.relay_pressure = 0.0
        self.stopped_reason: str | None = None
        self.n_sent = 0
        self.n_received = 0
        self.n_reconnects = 0
        self.uplink_bytes = 0
        self.downlink_bytes = 0
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self._drops: dict[str, int] = {}
        self._unacked = 0          # bytes handed to the page, not yet acknowledged
        self._buffered = 0         # the page socket's bufferedAmount at the last ack
        self._welcome: asyncio.Future | None = None
        self._resuming = False
        self._reconnect_task: asyncio.Task | None = None
        self._stalled: list[dict] | None = None
        self._held_bytes = 0       # chunk bytes taken off the socket and held while stalled
        self._backlog_sent = 0
        self._rng = random.Random()

    # ------------------------------------------------------------------ lifecycle
    async def connect(self, timeout_s: float = 10.0) -> "BrowserBus":
        """Open the page's socket, register, learn this rank's id.

        Raises:
            LinkFailed: the server refused (bad token, room full) or did not answer in time.
        """
        loop = asyncio.get_running_loop()
        t_end = loop.time() + self.reconnect_max_s
        attempt = 0
        while True:   # as WsBus.connect: a registration over the server's rate is retried
            try:
                await self._open(resume=False, timeout_s=timeout_s)
                break
            except LinkFailed as e:
                delay = full_jitter_s(attempt, self._rng)
                if e.code != CLOSE_RETRY_LATER or self.closed or loop.time() + delay > t_end:
                    raise
                attempt += 1
                await asyncio.sleep(delay)
        self.writer = FrameWriter(self.id, precision=self.precision, max_message_bytes=self.max_message_bytes,
                                  int8_block=self.int8_block, use_numpy=self.use_numpy)
        return self

    async def _open(self, *, resume: bool, timeout_s: float) -> None:
        self._welcome = asyncio.get_running_loop().create_future()
        self._resuming = resume
        self.hub.port.open(self.link, self.ws_url)
        try:
            await asyncio.wait_for(asyncio.shield(self._welcome), timeout_s)
        except asyncio.TimeoutError:
            self.hub.port.close(self.link)
            raise LinkFailed(f"cannot connect to {self.ws_url}: no welcome within {timeout_s} s") from None
        finally:
            self._welcome = None

    def close(self) -> None:
        """Stop delivery both ways (idempotent); the page closes the socket."""
        if self.closed:
            return
        self.closed = True
        self.on_message = None
        self.connected = False
        if self._reconnect_task is not None:
            self._reconnect_task.cancel()
        self.hub.links.pop(self.link, None)
        self.hub.port.close(self.link)

    async def aclose(self) -> None:
        self.close()
        if self._reconnect_task is not None:
            await asyncio.gather(self._reconnect_task, return_exceptions=True)

    # ------------------------------------------------------------------ the bus contract
    def post(self, msg: dict) -> None:
        """Encode ``msg`` and hand its chunks to the page's socket (all peers, or ``msg["to"]``).

        Raises:
            LocalProtocolError: the message cannot be encoded.
        """
        if self.closed or self.writer is None:
            return
        chunks = self.writer.write(msg)
        size = sum(map(len, chunks))
        if not self.connected:
            self._count("disconnected")
            return
        if self.queued_bytes() + size > self.max_queue_bytes:
            self._count("send_overflow")
            return
        to = msg.get("to")
        for p in ((to,) if to is not None else self.peers):
            if p != self.id:
                self._sent[p] = self._sent.get(p, 0) + size
        self.n_sent += len(chunks)
        self.uplink_bytes += size
        self._put(chunks, size)

    def _put(self, chunks: list[bytes], size: int) -> None:
        """Hand one frame's accounted chunks to the page's socket."""
        self._unacked += size
        self.hub.port.send_chunks(self.link, chunks)

    def send_raw(self, chunks: list[bytes]) -> bool:
        """Hand already-encoded chunks to the relay as they are (no per-peer accounting here).

        Returns:
            False when they were dropped (closed, disconnected or the queue bound).
        """
        size = sum(map(len, chunks))
        if self.closed or not self.connected:
            self._count("disconnected")
            return False
        if self.queued_bytes() + size > self.max_queue_bytes:
            self._count("send_overflow")
            return False
        self._unacked += size
        self.n_sent += len(chunks)
        self.uplink_bytes += size
        self.hub.port.send_chunks(self.link, chunks)
        return True

    def send_control(self, obj: dict) -> None:
        """A JSON control message (e.g. a state report) on the same socket."""
        if self.closed or not self.connected:
            return
        text = json.dumps(obj, separators=(",", ":"), default=str)
        self._send_text(text)

    def _send_text(self, text: str) -> None:
        self.n_sent += 1
        self.uplink_bytes += len(text)
        self._unacked += len(text)
        self.hub.port.send_text(self.link, text)

    def bytes(self) -> dict[int, LinkBytes]:
        peers = set(self._sent) | set(self._received)
        return {p: LinkBytes(self._sent.get(p, 0), self._received.get(p, 0)) for p in sorted(peers)}

    def total_bytes(self) -> int:
        return sum(self._sent.values()) + sum(self._received.values())

    def pressure(self) -> float:
        return max(self.queued_bytes() / self.high_water_bytes, self.relay_pressure)

    def queued_bytes(self) -> int:
        """Bytes not yet on the wire: handed to the page but not acknowledged, plus the socket's buffer."""
        return self._unacked + self._buffered

    def quantize(self, params: Any) -> Any:
        w = self.writer or FrameWriter(0, precision=self.precision, int8_block=self.int8_block,
                                       use_numpy=self.use_numpy)
        return w.quantize(params)

    def set_precision(self, precision: str) -> None:
        """Change the wire precision of what this rank sends from now on.

        Raises:
            ConfigError: an unknown precision.
        """
        w = FrameWriter(self.id, precision=precision, max_message_bytes=self.max_message_bytes,
                        int8_block=self.int8_block, use_numpy=self.use_numpy)
        self.precision = precision
        if self.writer is not None:
            self.writer = w

    def drops(self) -> dict[str, int]:
        out = dict(self.reader.drops)
        for k, v in self._drops.items():
            out[k] = out.get(k, 0) + v
        return out

    def links(self) -> list[dict]:
        """Per peer: transport, bytes sent and received (for the state report and the page)."""
        return [{"peer": p, "transport": self.transport, "sent": lb.sent, "received": lb.received}
                for p, lb in self.bytes().items()]

    def stall(self, stalled: bool) -> None:
        """Hold (True) or release (False) inbound chunks (tests: a black-holed consumer).

        The page cannot stop reading its socket, so held bytes are reported to the server as
        this rank's receive ``backlog``, which counts in the relay pressure every sender sees
        (what unread socket bytes do for a native rank)."""
        if stalled:
            if self._stalled is None:
                self._stalled = []
        else:
            held, self._stalled = self._stalled or [], None
            self._held_bytes = 0
            for it in held:
                self._on_port(it)
            self._report_backlog()

    def _report_backlog(self) -> None:
        """Tell the server what this rank holds unconsumed, when it moved by >= 1/8 of the
        high-water mark or went to 0 (the relay's own pressure rule, "Bus contract")."""
        n, last = self._held_bytes, self._backlog_sent
        if (n == 0) == (last == 0) and abs(n - last) < self.high_water_bytes // 8:
            return
        self._backlog_sent = n
        if self.connected and not self.closed:
            self._send_text(json.dumps({"type": "backlog", "bytes": n}))

    def _count(self, reason: str) -> None:
        self._drops[reason] = self._drops.get(reason, 0) + 1

    # ------------------------------------------------------------------ page messages
    def _on_port(self, it: dict) -> None:
        k = it.get("k")
        if self.closed:
            return
        if k == "ws-chunk":
            if self._stalled is not None:
                self._stalled.append(it)
                self._held_bytes += len(it["data"])
                self._report_backlog()
                return
            self._on_chunk(it["data"])
        elif k == "ws-text":
            text = it.get("text", "")
            self.n_received += 1
            self.downlink_bytes += len(text)
            try:
                obj = json.loads(text)
            except ValueError:
                self._count("bad_control")
                return
            if isinstance(obj, dict):
                self._handle_control(obj)
        elif k == "ack":
            self._unacked = max(0, self._unacked - int(it.get("bytes", 0)))
            self._buffered = int(it.get("buffered", 0))
        elif k == "ws-opened":
            reg: dict[str, Any] = {"type": "register", "version": 1}
            if self.token is not None:
                reg["token"] = self.token
            if self._resuming:
                reg["resume"] = {"id": self.id, "secret": self.secret}
            self._send_text(json.dumps(reg))
        elif k == "ws-closed":
            self._on_closed(int(it.get("code", 1006)), str(it.get("reason", "")))

    def _on_closed(self, code: int, reason: str) -> None:
        was_connected = self.connected
        self.connected = False
        self._unacked = self._buffered = 0
        self.relay_pressure = 0.0
        fut = self._welcome
        if fut is not None and not fut.done():
            if not self._resuming:
                fut.set_exception(LinkFailed(f"server refused the link (close {code}: {reason})", code))
                return
            fut.set_exception(ConnectionError(f"close {code}"))
            if code in _FATAL_CLOSE:   # a refused resume (4004): the tab may join again as a new rank
                self._fail(f"server closed the link: code {code} {reason}", rejoin=code == CLOSE_UNKNOWN_ID)
            return
        if not was_connected:
            return
        if code in _FATAL_CLOSE:
            self._fail(f"server closed the link: code {code} {reason}")
            return
        log.warning("rank %08x: link lost (code %s); reconnecting", self.id, code)
        self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        loop = asyncio.get_running_loop()
        t_end = loop.time() + self.reconnect_max_s
        attempt = 0
        while not self.closed and loop.time() < t_end:
            await asyncio.sleep(full_jitter_s(attempt, self._rng))   # full jitter (bus/backoff.py)
            attempt += 1
            try:
                await self._open(resume=True, timeout_s=10.0)
            except (LinkFailed, ConnectionError) as e:
                if self.failed:
                    return
                log.info("rank %08x: reconnect failed: %r", self.id, e)
                continue
            self.n_reconnects += 1
            return
        if not self.closed:
            self._fail(f"gave up reconnecting after {self.reconnect_max_s} s")

    def _fail(self, why: str, *, rejoin: bool = False) -> None:
        """As :meth:`WsBus._fail <tabcohort.bus.ws.WsBus._fail>`."""
        self.failed = why
        (log.warning if rejoin else log.error)("rank %08x: %s", self.id, why)
        if self.on_control is not None:
            self.on_control({"type": "failed", "reason": why, "rejoin": rejoin})

    def _on_chunk(self, chunk: bytes) -> None:
        self.n_received += 1
        self.downlink_bytes += len(chunk)
        if self.on_chunk is not None:
            self.on_chunk(chunk)
            return
        try:
            sender = parse_route(chunk).sender
        except RemoteProtocolError:
            sender = 0
        self._received[sender] = self._received.get(sender, 0) + len(chunk)
        now_ms = asyncio.get_running_loop().time() * 1000.0
        for m in self.reader.feed(chunk, now_ms=now_ms):
            cb = self.on_message
            if cb is not None and not self.closed:
                cb(m)

    def _handle_control(self, obj: dict) -> None:
        t = obj.get("type")
        if t == "welcome":
            try:
                self.id, self.secret = int(obj["id"]), str(obj["secret"])
                self.peers = set(int(k) for k in obj.get("peers", ()))
            except (KeyError, TypeError, ValueError):
                self._count("bad_control")
                return
            self.connected = True
            fut = self._welcome
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif t == "peer":
            k = obj.get("id")
            if isinstance(k, int) and k != self.id:
                (self.peers.add if obj.get("up") else self.peers.discard)(k)
        elif t == "pressure":
            p = obj.get("p")
            if isinstance(p, (int, float)) and not isinstance(p, bool):
                self.relay_pressure = float(p)
        elif t == "stop":
            self.stopped_reason = str(obj.get("reason"))
        if self.on_control is not None:
            try:
                self.on_control(obj)
            except Exception:
                log.exception("on_control callback failed")




class _PageChannel:
    """The worker's view of one page-owned ``RTCDataChannel`` (one generation of one pair).

    ``bufferedAmount`` is what the page has not yet put on the wire as far as the worker knows:
    bytes handed to the page and not yet acknowledged, plus the channel's ``bufferedAmount`` at
    the last acknowledgement (the same accounting as :class:`BrowserBus`). ``send`` batches; the
    bus flushes one transfer per drain.
    """

    def __init__(self, port: Any, link: int, peer: int, gen: int) -> None:
        self.port, self.link, self.peer, self.gen = port, link, peer, gen
        self.readyState = "connecting"
        self.unacked = 0
        self.page_buffered = 0
        self._batch: list[bytes] = []

    @property
    def bufferedAmount(self) -> int:  # noqa: N802  (the W3C name, as aiortc's channel has it)
        return self.unacked + self.page_buffered

    def send(self, chunk: bytes) -> None:
        self._batch.append(chunk)
        self.unacked += len(chunk)

    def flush(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self.port.rtc_send(self.link, self.peer, self.gen, batch)


class BrowserMeshBus(RtcMeshBus):
    """A tab's bus over a WebRTC mesh: the page's own ``RTCPeerConnection`` per pair, one ordered
    reliable binary data channel each, negotiated through the server over the page's WebSocket;
    a pair whose channel does not open within ``connect_timeout_s`` (or fails, or goes idle)
    uses the server relay. The link state machine, chunking (at each channel's negotiated max
    message size), flow control and byte accounting are :class:`~tabcohort.bus.rtc.RtcMeshBus`'s
    (the same code as a native mesh rank); only the peer connections live in the page.

    Worker -> page (``web/app.js``): ``{k: "rtc-open", link, peer, gen, offer, ice, low_water,
    sdp?}`` (``offer``: this side creates the channel and offers; else ``sdp`` is the remote
    offer to answer), ``{k: "rtc-signal", link, peer, gen, signal}`` (a remote answer or
    candidate), ``{k: "rtc-send", link, peer, gen, data: [ArrayBuffer...]}`` (transferred),
    ``{k: "rtc-close", link, peer, gen}``. Page -> worker: ``rtc-local`` (``text``: a signal to
    forward to the peer, JSON), ``rtc-up`` (``bytes``: the negotiated max message size),
    ``rtc-chunk`` (``data``), ``rtc-ack`` (``bytes`` put on the channel, its ``buffered``
    amount), ``rtc-down`` (``reason``). ``gen`` numbers each peer connection so that events of a
    replaced one are ignored (counted as ``stale_link_event``).

    The page offers and answers with complete SDP (it waits for ICE gathering, bounded), so the
    native side (aiortc, which does not trickle) and tabs interoperate without trickling.

    Args:
        hub: this worker's :class:`PortHub`.
        ws_url, token, precision, ice_servers, connect_timeout_s, idle_timeout_s,
        high_water_bytes, channel_high_water_bytes, channel_low_water_bytes, max_queue_bytes,
        int8_block, use_numpy, on_control: as for :class:`~tabcohort.bus.rtc.RtcMeshBus`.
    """

    transport = "rtc-mesh"

    def __init__(self, hub: PortHub, ws_url: str, **kw: Any) -> None:
        self.hub = hub
        self._gen = 0
        super().__init__(ws_url, **kw)
        self.link = hub.new_link(self)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ backend hooks
    def _relay_link(self, ws_url: str, **kw: Any) -> Any:
        return BrowserBus(self.hub, ws_url, **kw)

    def _check_backend(self) -> None:
        pass

    def _gate_links(self, links: list) -> None:
        pass  # chunks that arrive while stalled are held by RtcMeshBus._on_rtc_chunk

    def _on_rtc_chunk(self, lk: Any, chunk: bytes) -> None:
        stalled = not self._stall_gate.is_set()
        super()._on_rtc_chunk(lk, chunk)
        if stalled:  # held: the page cannot pause the channel, so tell the sender (backlog)
            lk.held_bytes += len(chunk)
            self._report_backlog(lk)

    def stall(self, stalled: bool) -> None:
        super().stall(stalled)
        if not stalled:
            for lk in list(self.links_.values()):
                lk.held_bytes = 0
                self._report_backlog(lk)

    def _report_backlog(self, lk: Any) -> None:
        """Tell the peer how many of its bytes this rank holds unconsumed (signal ``backlog``,
        through the server), when it moved by >= 1/8 of the high-water mark or went to 0; the
        peer counts it as buffered on that link, so its ``pressure()`` rises."""
        n, last = lk.held_bytes, lk.backlog_sent
        if (n == 0) == (last == 0) and abs(n - last) < self.high_water_bytes // 8:
            return
        lk.backlog_sent = n
        self.ws.send_control({"type": "signal", "to": lk.peer, "kind": "backlog", "bytes": n})

    def _open_pc(self, lk: Any, *, offer: bool, sdp: str | None = None) -> None:
        self._gen += 1
        ch = _PageChannel(self.hub.port, self.link, lk.peer, self._gen)
        lk.pc = lk.channel = ch
        msg: dict[str, Any] = {"k": "rtc-open", "link": self.link, "peer": lk.peer, "gen": ch.gen, "offer": offer,
                               "ice": ice_server_dicts(self.ice_servers), "low_water": self.channel_low_water_bytes}
        if sdp is not None:
            msg["sdp"] = sdp
        self.hub.port.rtc(msg)

    async def _offer(self, lk: Any) -> None:
        self._open_pc(lk, offer=True)

    async def _answer(self, lk: Any, sdp: str) -> None:
        if lk.pc is not None:
            self._close_pc(lk)
        self._open_pc(lk, offer=False, sdp=sdp)

    async def _accept(self, lk: Any, sdp: str) -> None:
        self._signal(lk, {"kind": "answer", "sdp": sdp})

    def _add_candidate(self, lk: Any, candidate: dict) -> None:
        self._signal(lk, {"kind": "candidate", "candidate": candidate})

    def _signal(self, lk: Any, signal: dict) -> None:
        ch = lk.pc
        if ch is not None:
            self.hub.port.rtc({"k": "rtc-signal", "link": self.link, "peer": lk.peer, "gen": ch.gen,
                               "signal": signal})

    def _drain(self, lk: Any) -> None:
        super()._drain(lk)
        ch = lk.channel
        if ch is not None:
            ch.flush()

    def _close_pc(self, lk: Any) -> None:
        ch, lk.pc, lk.channel = lk.pc, None, None
        if ch is not None:
            ch.readyState = "closed"
            self.hub.port.rtc({"k": "rtc-close", "link": self.link, "peer": lk.peer, "gen": ch.gen})

    # ------------------------------------------------------------------ page events
    def _on_port(self, it: dict) -> None:
        if self.closed:
            return
        k, peer = it.get("k"), it.get("peer")
        lk = self.links_.get(peer) if isinstance(peer, int) else None
        ch = lk.channel if lk is not None else None
        if ch is None or it.get("gen") != ch.gen:
            self._count("stale_link_event")
            return
        if k == "rtc-chunk":
            self._on_rtc_chunk(lk, it["data"])
        elif k == "rtc-ack":
            ch.unacked = max(0, ch.unacked - int(it.get("bytes", 0)))
            ch.page_buffered = int(it.get("buffered", 0))
            self._drain(lk)
        elif k == "rtc-local":
            try:
                signal = json.loads(it.get("text", ""))
            except ValueError:
                self._count("bad_signal")
                return
            if isinstance(signal, dict) and signal.get("kind") in ("offer", "answer", "candidate"):
                self.ws.send_control({**signal, "type": "signal", "to": lk.peer})
        elif k == "rtc-up":
            ch.readyState = "open"
            self._channel_opened(lk, int(it.get("bytes") or DEFAULT_MAX_MESSAGE_BYTES))
        elif k == "rtc-down":
            ch.readyState = "closed"
            if lk.kind != "relay":
                self._fallback(lk, str(it.get("reason") or "data channel closed"))

    # ------------------------------------------------------------------ what the tab shows
    def set_precision(self, precision: str) -> None:
        """Change the wire precision of what this rank sends from now on.

        Raises:
            ConfigError: an unknown precision.
        """
        w = FrameWriter(self.id, precision=precision, int8_block=self.int8_block, use_numpy=self.use_numpy)
        self.precision = precision
        if self.writer is not None:
            self.writer = w
        self.ws.set_precision(precision)

    @property
    def n_reconnects(self) -> int:
        return self.ws.n_reconnects

    @property
    def uplink_bytes(self) -> int:
        """Bytes sent on the WebSocket and on every data channel."""
        return self.ws.uplink_bytes + sum(lk.rtc_sent for lk in self.links_.values())

    @property
    def downlink_bytes(self) -> int:
        return self.ws.downlink_bytes + sum(lk.rtc_received for lk in self.links_.values())

    def link_rows(self) -> list[dict]:
        """Per peer: its path (``rtc`` | ``relay`` | ``connecting``) and bytes each way."""
        return [{"peer": p, "transport": lk.kind, "sent": lk.sent, "received": lk.received}
                for p, lk in sorted(self.links_.items())]

    def paths(self) -> dict[str, str]:
        """Each peer's path keyed as native ranks report it (``{"%08x": "rtc"|"relay"|...}``)."""
        return {f"{p:08x}": lk.kind for p, lk in sorted(self.links_.items())}


class BrowserRtcStarBus(BrowserBus):
    """A tab's star link over WebRTC: chunks to and from the server go on one page-owned data
    channel (the server terminates it with aiortc, ``tabcohort_server.rtc_relay``), negotiated
    over the page's WebSocket, which keeps carrying the controls; the tab's counterpart of
    :class:`~tabcohort.bus.rtc.RtcStarBus` (``--link rtc``).

    Until the channel opens (bounded by ``connect_timeout_s``), or after it closes, chunks go on
    the WebSocket. Chunks for the channel wait in this bus's queue while the channel's
    ``bufferedAmount`` as last acknowledged by the page plus the unacknowledged bytes is at or
    above ``channel_high_water_bytes`` (Chromium closes a channel whose buffer overflows), so
    ``pressure()`` sees them. Page messages as for :class:`BrowserMeshBus`, with ``peer`` 0.
    """

    transport = "rtc-star"

    def __init__(self, hub: PortHub, ws_url: str, *, ice_servers: Any = None,
                 connect_timeout_s: float = 5.0, channel_high_water_bytes: int = 1 << 20,
                 channel_low_water_bytes: int = 256 << 10, **kw: Any) -> None:
        from .rtc_util import parse_ice_servers

        if not (isinstance(connect_timeout_s, (int, float)) and connect_timeout_s > 0):
            raise ConfigError("connect_timeout_s", connect_timeout_s, "must be a positive number of seconds")
        super().__init__(hub, ws_url, **kw)
        self.ice_servers = parse_ice_servers(ice_servers)
        self.connect_timeout_s = float(connect_timeout_s)
        self.channel_high_water_bytes = channel_high_water_bytes
        self.channel_low_water_bytes = channel_low_water_bytes
        self.channel: _PageChannel | None = None
        self.rtc_up = False
        self.rtc_why: str | None = None
        self.rtc_sent = 0
        self.rtc_received = 0
        self.ws_chunk_bytes_out = 0
        self.chunk_bytes_in = 0
        self._rtc_queue: deque[bytes] = deque()
        self._rtc_queued = 0
        self._gen = 0

    async def connect(self, timeout_s: float = 10.0) -> "BrowserRtcStarBus":
        """Register on the WebSocket, then open the data channel to the server (bounded; the
        channel failing is not fatal: the WebSocket carries the chunks).

        Raises:
            LinkFailed: the server refused or did not answer.
        """
        await super().connect(timeout_s)
        self._gen += 1
        self.channel = _PageChannel(self.hub.port, self.link, 0, self._gen)
        self.hub.port.rtc({"k": "rtc-open", "link": self.link, "peer": 0, "gen": self._gen, "offer": True,
                           "ice": ice_server_dicts(self.ice_servers), "low_water": self.channel_low_water_bytes})
        loop = asyncio.get_running_loop()
        end = loop.time() + self.connect_timeout_s
        while not self.rtc_up and self.rtc_why is None and loop.time() < end:
            await asyncio.sleep(0.02)
        if not self.rtc_up:
            self._rtc_down(f"channel to the server not open within {self.connect_timeout_s:g} s")
        return self

    def close(self) -> None:
        if not self.closed and self.channel is not None:
            self.hub.port.rtc({"k": "rtc-close", "link": self.link, "peer": 0, "gen": self.channel.gen})
        self.rtc_up = False
        super().close()

    def _put(self, chunks: list[bytes], size: int) -> None:
        """As :meth:`BrowserBus._put`, but on the data channel while it is open."""
        if not self.rtc_up:
            super()._put(chunks, size)
            self.ws_chunk_bytes_out += size
            return
        self._rtc_queue.extend(chunks)
        self._rtc_queued += size
        self._drain()

    def queued_bytes(self) -> int:
        ch = self.channel
        return super().queued_bytes() + self._rtc_queued + (ch.bufferedAmount if ch is not None else 0)

    def _drain(self) -> None:
        ch = self.channel
        if ch is None:
            return
        while self._rtc_queue and ch.bufferedAmount < self.channel_high_water_bytes:
            c = self._rtc_queue.popleft()
            self._rtc_queued -= len(c)
            ch.send(c)
            self.rtc_sent += len(c)
        ch.flush()

    def _rtc_down(self, why: str) -> None:
        if self.rtc_why is None and not self.closed:
            self.rtc_why = why
            log.warning("rank %08x: star link uses the WebSocket: %s", self.id, why)
        self.rtc_up = False
        if self._rtc_queue:  # not on the wire: resend on the socket, in order
            held, self._rtc_queue = list(self._rtc_queue), deque()
            self._rtc_queued = 0
            self._unacked += sum(map(len, held))
            self.ws_chunk_bytes_out += sum(map(len, held))
            self.hub.port.send_chunks(self.link, held)

    def _on_port(self, it: dict) -> None:
        k = it.get("k", "")
        if not k.startswith("rtc-"):
            super()._on_port(it)
            return
        ch = self.channel
        if self.closed or ch is None or it.get("gen") != ch.gen:
            self._count("stale_link_event")
            return
        if k == "rtc-chunk":
            self.rtc_received += len(it["data"])
            self._on_port({"k": "ws-chunk", "data": it["data"]})
        elif k == "rtc-ack":
            ch.unacked = max(0, ch.unacked - int(it.get("bytes", 0)))
            ch.page_buffered = int(it.get("buffered", 0))
            self._drain()
        elif k == "rtc-local":
            try:
                signal = json.loads(it.get("text", ""))
            except ValueError:
                self._count("bad_signal")
                return
            if isinstance(signal, dict) and signal.get("kind") == "offer":
                self.send_control({**signal, "type": "signal", "to": 0})
        elif k == "rtc-up":
            ch.readyState = "open"
            self.rtc_up = self.rtc_why is None
            if self.writer is not None:
                self.writer.max_message_bytes = min(self.max_message_bytes,
                                                    int(it.get("bytes") or DEFAULT_MAX_MESSAGE_BYTES))
        elif k == "rtc-down":
            ch.readyState = "closed"
            self._rtc_down(str(it.get("reason") or "data channel closed"))

    def _on_chunk(self, chunk: bytes) -> None:
        self.chunk_bytes_in += len(chunk)
        super()._on_chunk(chunk)

    def _handle_control(self, obj: dict) -> None:
        ch = self.channel
        if obj.get("type") == "signal" and obj.get("from") == 0:
            if obj.get("kind") == "answer" and isinstance(obj.get("sdp"), str) and ch is not None:
                self.hub.port.rtc({"k": "rtc-signal", "link": self.link, "peer": 0, "gen": ch.gen,
                                   "signal": {"kind": "answer", "sdp": obj["sdp"]}})
            return
        super()._handle_control(obj)

    def links(self) -> list[dict]:
        t = "rtc-star" if self.rtc_up else "ws-star"
        return [{"peer": p, "transport": t, "sent": lb.sent, "received": lb.received}
                for p, lb in self.bytes().items()]

    def link_rows(self) -> list[dict]:
        return self.links()

    def transport_bytes(self) -> dict[str, int]:
        """Chunk bytes this rank's link carried (up + down) on the channel and on the WebSocket."""
        return {"rtc": self.rtc_sent + self.rtc_received,
                "ws": self.ws_chunk_bytes_out + self.chunk_bytes_in - self.rtc_received}

    def paths(self) -> dict[str, str]:
        return {"server": "rtc" if self.rtc_up else "ws"}


__all__ = ["BrowserBus", "BrowserMeshBus", "BrowserRtcStarBus", "JsPort", "PortHub", "LinkFailed",
           "TabcohortError", "TRANSPORT"]
