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
from typing import Any, Callable

from ..errors import ConfigError, RemoteProtocolError, TabcohortError
from ..wire import DEFAULT_MAX_MESSAGE_BYTES, FrameReader, FrameWriter, WireLimits, parse_route
from ..wire.codecs import DEFAULT_INT8_BLOCK
from .base import LinkBytes
from .ws import _FATAL_CLOSE, DEFAULT_HIGH_WATER_BYTES, DEFAULT_MAX_QUEUE_BYTES, LinkFailed

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

    def proxy(self, fn: Callable) -> Any:
        """A JS-callable proxy of ``fn``; destroyed by :meth:`destroy`."""
        p = self._create_proxy(fn)
        self._proxies.append(p)
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
            for key in ("link", "code", "bytes", "buffered", "text", "reason", "action", "value", "url"):
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
        self._rng = random.Random()

    # ------------------------------------------------------------------ lifecycle
    async def connect(self, timeout_s: float = 10.0) -> "BrowserBus":
        """Open the page's socket, register, learn this rank's id.

        Raises:
            LinkFailed: the server refused (bad token, room full) or did not answer in time.
        """
        await self._open(resume=False, timeout_s=timeout_s)
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
        self._unacked += size
        self.n_sent += len(chunks)
        self.uplink_bytes += size
        self.hub.port.send_chunks(self.link, chunks)

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
        """Hold (True) or release (False) inbound chunks (tests: a black-holed consumer)."""
        if stalled:
            if self._stalled is None:
                self._stalled = []
        else:
            held, self._stalled = self._stalled or [], None
            for it in held:
                self._on_port(it)

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
                fut.set_exception(LinkFailed(f"server refused the link (close {code}: {reason})"))
                return
            fut.set_exception(ConnectionError(f"close {code}"))
            if code in _FATAL_CLOSE:
                self._fail(f"server closed the link: code {code} {reason}")
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
        delay = 0.1
        while not self.closed and loop.time() < t_end:
            await asyncio.sleep(delay * self._rng.uniform(0.5, 1.5))
            delay = min(delay * 2, 5.0)
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

    def _fail(self, why: str) -> None:
        self.failed = why
        log.error("rank %08x: %s", self.id, why)
        if self.on_control is not None:
            self.on_control({"type": "failed", "reason": why})

    def _on_chunk(self, chunk: bytes) -> None:
        self.n_received += 1
        self.downlink_bytes += len(chunk)
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


__all__ = ["BrowserBus", "JsPort", "PortHub", "LinkFailed", "TabcohortError", "TRANSPORT"]
