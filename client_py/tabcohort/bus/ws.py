"""WebSocket star bus: every rank has one link, to the server, which relays by routing header.

Native only (aiohttp client). aiohttp is imported inside :meth:`WsBus.connect`, so importing
``tabcohort.bus`` never needs it.

Wire (same socket, two message kinds):

- binary messages: chunks exactly as :class:`~tabcohort.wire.FrameWriter` writes them;
- text messages: JSON control, ``{"type": ...}``. Rank -> server: ``register`` (first message:
  ``token``, optional ``resume: {id, secret}``), ``report`` (``state``). Server -> rank:
  ``welcome`` (``id``, ``secret``, ``peers``), ``peer`` (``id``, ``up``), ``pressure`` (``p``:
  the relay's max queue / high-water mark), ``stop`` (``reason``).

Byte accounting (the bus contract's ``bytes()``): per *peer id*, the chunk bytes this rank
sent to that peer through the relay and received from it (chunk headers included). A broadcast
counts once per peer the relay forwards it to (the peers this bus knows from ``welcome`` and
``peer`` controls), which is what the relay puts on the wire. Control (JSON) messages are not
protocol traffic and are not in ``bytes()``; :attr:`uplink_bytes` / :attr:`downlink_bytes` are
the raw socket totals, controls included.

``pressure()`` is ``max(bytes in this bus's send queue / high_water_bytes, relay pressure)``:
the relay reports its own slowest queue, so a leader paces on a stalled peer behind the relay.

A dropped socket is reconnected with the same id (the server holds it for its grace period)
with full-jitter exponential backoff (:mod:`tabcohort.bus.backoff`); posts while disconnected are
dropped (``disconnected``). Server close codes (docs/INTERFACES.md, "Close codes"): 4029 (the
server admits registrations at a bounded rate) is retried after the next backoff delay, at
connect and at reconnect alike; 4004 on a resume (the server no longer knows the id: its grace
expired, or it restarted without its checkpoint directory) ends the link with a ``failed``
control carrying ``rejoin: True``, and the runtime joins again as a new rank; 4000, 4001 and
4009 end the link for good.
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
from .backoff import full_jitter_s
from .base import LinkBytes

log = logging.getLogger("tabcohort.bus.ws")

DEFAULT_HIGH_WATER_BYTES = 1 << 20
#: The send queue bound: beyond it new posts are dropped (``send_overflow``).
DEFAULT_MAX_QUEUE_BYTES = 64 << 20
CLOSE_UNKNOWN_ID = 4004
CLOSE_BAD_TOKEN = 4001
#: the server's admission rate limit: registrations beyond it are closed with this; retry later
CLOSE_RETRY_LATER = 4029
_FATAL_CLOSE = {4000, CLOSE_BAD_TOKEN, CLOSE_UNKNOWN_ID, 4009}


class LinkFailed(TabcohortError):
    """The link to the server is gone for good (bad token, id no longer reserved, gave up).

    Attributes:
        code: the server's WebSocket close code, when it closed the link (else ``None``).
    """

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class WsBus:
    """One rank's bus over the server's star relay (the bus contract, PROTOCOL.md).

    Args:
        ws_url: ``ws://host:port/api/rooms/{room}/ws`` (see :func:`ws_url`).
        token: the room token, if any.
        precision: wire precision of this rank's writer.
        max_message_bytes: chunk size limit, header included.
        high_water_bytes: send-queue bytes at which ``pressure()`` reaches 1.
        heartbeat_s: WebSocket ping period.
        reconnect_max_s: give up reconnecting after this long (the server's grace period).
        on_control: called with every server control message (dict) after the bus handled it.
    """

    def __init__(self, ws_url: str, *, token: str | None = None, precision: str = "f32",
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 high_water_bytes: int = DEFAULT_HIGH_WATER_BYTES, int8_block: int = DEFAULT_INT8_BLOCK,
                 limits: WireLimits | None = None, use_numpy: bool | None = None,
                 heartbeat_s: float = 10.0, reconnect_max_s: float = 30.0,
                 max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
                 on_control: Callable[[dict], None] | None = None) -> None:
        if not isinstance(high_water_bytes, int) or high_water_bytes < 1:
            raise ConfigError("high_water_bytes", high_water_bytes, "must be a positive int")
        FrameWriter(0, precision=precision, max_message_bytes=max_message_bytes, int8_block=int8_block)
        self.ws_url = ws_url
        self.token = token
        self.precision = precision
        self.max_message_bytes = max_message_bytes
        self.int8_block = int8_block
        self.use_numpy = use_numpy
        self.high_water_bytes = high_water_bytes
        self.heartbeat_s = heartbeat_s
        self.reconnect_max_s = reconnect_max_s
        self.max_queue_bytes = max_queue_bytes
        self.on_control = on_control
        self.on_message: Callable[[dict], None] | None = None
        #: When set, every inbound chunk goes here raw instead of to this bus's reader and byte
        #: counts (the mesh bus, which counts and decodes every path in one place).
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
        self.n_sent = 0          # socket messages written (chunks + controls)
        self.n_received = 0      # socket messages read (chunks + controls)
        self.n_reconnects = 0
        self.uplink_bytes = 0
        self.downlink_bytes = 0
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self._drops: dict[str, int] = {}
        self._queue: deque[bytes | str] = deque()
        self._queued_bytes = 0
        self._wake: asyncio.Event | None = None
        self._recv_gate: asyncio.Event | None = None
        self._session: Any = None
        self._ws: Any = None
        self._tasks: list[asyncio.Task] = []
        self._rng = random.Random()

    # ------------------------------------------------------------------ lifecycle
    async def connect(self, timeout_s: float = 10.0) -> "WsBus":
        """Open the socket, register, and learn this rank's id (``self.id``).

        Raises:
            LinkFailed: the server refused (bad token, room full) or did not answer in time.
        """
        import aiohttp

        self._wake = asyncio.Event()
        self._recv_gate = asyncio.Event()
        self._recv_gate.set()
        self._session = aiohttp.ClientSession()
        loop = asyncio.get_running_loop()
        t_end = loop.time() + self.reconnect_max_s
        attempt = 0
        while True:
            try:
                await asyncio.wait_for(self._open(resume=False), timeout_s)
                break
            except (asyncio.TimeoutError, OSError, aiohttp.ClientError) as e:
                await self._session.close()
                raise LinkFailed(f"cannot connect to {self.ws_url}: {type(e).__name__}: {e}") from None
            except LinkFailed as e:
                delay = full_jitter_s(attempt, self._rng)
                if e.code != CLOSE_RETRY_LATER or self.closed or loop.time() + delay > t_end:
                    await self._session.close()
                    raise
                attempt += 1
                log.info("server admits registrations at a bounded rate (close %s); retry in %.2f s",
                         e.code, delay)
                await asyncio.sleep(delay)
        self.writer = FrameWriter(self.id, precision=self.precision, max_message_bytes=self.max_message_bytes,
                                  int8_block=self.int8_block, use_numpy=self.use_numpy)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._send_loop()), loop.create_task(self._recv_loop())]
        return self

    async def _open(self, *, resume: bool) -> None:
        ws = await self._session.ws_connect(self.ws_url, heartbeat=self.heartbeat_s,
                                            max_msg_size=1 << 20, autoping=True)
        reg: dict[str, Any] = {"type": "register", "version": 1}
        if self.token is not None:
            reg["token"] = self.token
        if resume:
            reg["resume"] = {"id": self.id, "secret": self.secret}
        await ws.send_str(json.dumps(reg))
        import aiohttp
        msg = await ws.receive()
        if msg.type != aiohttp.WSMsgType.TEXT:
            code = ws.close_code
            reason = getattr(msg, "extra", None) or ""
            await ws.close()
            raise LinkFailed(f"server refused the link (close {code}: {reason})", code)
        w = json.loads(msg.data)
        if w.get("type") != "welcome":
            await ws.close()
            raise LinkFailed(f"expected welcome, got {w.get('type')!r}")
        self.id, self.secret = int(w["id"]), str(w["secret"])
        self.peers = set(int(k) for k in w.get("peers", ()))
        self._ws = ws
        self.connected = True
        self.n_received += 1
        self.downlink_bytes += len(msg.data)
        self._handle_control(w)

    def close(self) -> None:
        """Stop delivery both ways (idempotent). Use :meth:`aclose` to wait for the socket."""
        if self.closed:
            return
        self.closed = True
        self.on_message = None
        self.connected = False
        for t in self._tasks:
            t.cancel()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.create_task(self._teardown())

    async def aclose(self) -> None:
        self.close()
        await self._teardown()

    async def _teardown(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        ws, self._ws = self._ws, None
        if ws is not None and not ws.closed:
            try:
                await asyncio.wait_for(ws.close(), 2.0)
            except (asyncio.TimeoutError, OSError):
                pass
        s, self._session = self._session, None
        if s is not None:
            await s.close()

    # ------------------------------------------------------------------ the bus contract
    def post(self, msg: dict) -> None:
        """Encode ``msg`` and queue its chunks to the relay (all peers, or ``msg["to"]``).

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
        if self._queued_bytes + size > self.max_queue_bytes:
            self._count("send_overflow")
            return
        to = msg.get("to")
        for p in ((to,) if to is not None else self.peers):
            if p != self.id:
                self._sent[p] = self._sent.get(p, 0) + size
        self._queue.extend(chunks)
        self._queued_bytes += size
        self._wake.set()

    def send_raw(self, chunks: list[bytes]) -> bool:
        """Queue already-encoded chunks to the relay as they are (no byte accounting here).

        Returns:
            False when they were dropped (closed, disconnected or the queue bound).
        """
        size = sum(map(len, chunks))
        if self.closed or not self.connected:
            self._count("disconnected")
            return False
        if self._queued_bytes + size > self.max_queue_bytes:
            self._count("send_overflow")
            return False
        self._queue.extend(chunks)
        self._queued_bytes += size
        self._wake.set()
        return True

    def send_control(self, obj: dict) -> None:
        """Queue a JSON control message (e.g. a state report) on the same socket."""
        if self.closed or not self.connected:
            return
        text = json.dumps(obj, separators=(",", ":"), default=str)
        self._queue.append(text)
        self._queued_bytes += len(text)
        self._wake.set()

    def bytes(self) -> dict[int, LinkBytes]:
        peers = set(self._sent) | set(self._received)
        return {p: LinkBytes(self._sent.get(p, 0), self._received.get(p, 0)) for p in sorted(peers)}

    def total_bytes(self) -> int:
        return sum(self._sent.values()) + sum(self._received.values())

    def pressure(self) -> float:
        return max(self._queued_bytes / self.high_water_bytes, self.relay_pressure)

    def quantize(self, params: Any) -> Any:
        w = self.writer or FrameWriter(0, precision=self.precision, int8_block=self.int8_block,
                                       use_numpy=self.use_numpy)
        return w.quantize(params)

    def drops(self) -> dict[str, int]:
        out = dict(self.reader.drops)
        for k, v in self._drops.items():
            out[k] = out.get(k, 0) + v
        return out

    def queued_bytes(self) -> int:
        return self._queued_bytes

    def stall(self, stalled: bool) -> None:
        """Stop (True) or resume (False) reading the socket (tests: a black-holed consumer)."""
        if self._recv_gate is not None:
            (self._recv_gate.clear if stalled else self._recv_gate.set)()

    def _count(self, reason: str) -> None:
        self._drops[reason] = self._drops.get(reason, 0) + 1

    # ------------------------------------------------------------------ tasks
    async def _send_loop(self) -> None:
        while not self.closed:
            await self._wake.wait()
            self._wake.clear()
            while self._queue and self.connected:
                item = self._queue[0]
                ws = self._ws
                try:
                    if isinstance(item, str):
                        await ws.send_str(item)
                    else:
                        await self._send_chunk(ws, item)
                except (ConnectionError, RuntimeError, OSError):
                    break  # the receive loop notices and reconnects
                if self._queue and self._queue[0] is item:
                    self._queue.popleft()
                    self._queued_bytes -= len(item)
                self.n_sent += 1
                self.uplink_bytes += len(item)

    async def _send_chunk(self, ws: Any, chunk: bytes) -> None:
        """Put one chunk on the link (the WebRTC star link overrides this)."""
        await ws.send_bytes(chunk)

    async def _recv_loop(self) -> None:
        import aiohttp

        while not self.closed:
            ws = self._ws
            while True:
                await self._recv_gate.wait()
                msg = await ws.receive()
                await self._recv_gate.wait()  # a stall that began mid-receive holds this one too
                if msg.type == aiohttp.WSMsgType.BINARY:
                    self._on_chunk(msg.data)
                elif msg.type == aiohttp.WSMsgType.TEXT:
                    self.n_received += 1
                    self.downlink_bytes += len(msg.data)
                    try:
                        obj = json.loads(msg.data)
                    except ValueError:
                        self._count("bad_control")
                        continue
                    if isinstance(obj, dict):
                        self._handle_control(obj)
                else:
                    break
            code = ws.close_code
            self._link_down()
            if self.closed:
                return
            if code in _FATAL_CLOSE:
                self._fail(f"server closed the link: code {code}")
                return
            log.warning("rank %08x: link lost (code %s); reconnecting", self.id, code)
            if not await self._reconnect():
                return

    def _link_down(self) -> None:
        self.connected = False
        if self._queue:
            self._drops["disconnected"] = self._drops.get("disconnected", 0) + len(self._queue)
        self._queue.clear()
        self._queued_bytes = 0
        self.relay_pressure = 0.0

    async def _reconnect(self) -> bool:
        import aiohttp

        loop = asyncio.get_running_loop()
        t_end = loop.time() + self.reconnect_max_s
        attempt = 0
        while not self.closed and loop.time() < t_end:
            await asyncio.sleep(full_jitter_s(attempt, self._rng))
            attempt += 1
            try:
                await asyncio.wait_for(self._open(resume=True), 10.0)
            except LinkFailed as e:
                if e.code == CLOSE_RETRY_LATER:
                    log.info("rank %08x: reconnect deferred by the server (close %s)", self.id, e.code)
                    continue
                self._fail(str(e), rejoin=e.code == CLOSE_UNKNOWN_ID)
                return False
            except (asyncio.TimeoutError, OSError, aiohttp.ClientError, ValueError) as e:
                log.info("rank %08x: reconnect failed: %r", self.id, e)
                continue
            self.n_reconnects += 1
            self._wake.set()
            return True
        self._fail(f"gave up reconnecting after {self.reconnect_max_s} s")
        return False

    def _fail(self, why: str, *, rejoin: bool = False) -> None:
        """The link is gone for good; ``rejoin``: the server refused the resume (4004), so the
        rank may join again as a new rank (``failed`` control with ``rejoin: True``)."""
        self.failed = why
        (log.warning if rejoin else log.error)("rank %08x: %s", self.id, why)
        if self.on_control is not None:
            self.on_control({"type": "failed", "reason": why, "rejoin": rejoin})

    def _on_chunk(self, chunk: bytes) -> None:
        self.n_received += 1
        self.downlink_bytes += len(chunk)
        if self.on_chunk is not None:
            if not self.closed:
                self.on_chunk(chunk)
            return
        try:
            sender = parse_route(chunk).sender
        except RemoteProtocolError:
            sender = 0
        self._received[sender] = self._received.get(sender, 0) + len(chunk)
        loop_ms = asyncio.get_running_loop().time() * 1000.0
        for m in self.reader.feed(chunk, now_ms=loop_ms):
            cb = self.on_message
            if cb is not None and not self.closed:
                cb(m)

    def _handle_control(self, obj: dict) -> None:
        t = obj.get("type")
        if t == "peer":
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


def ws_url(server: str, room: str) -> str:
    """``http(s)://host:port`` (or ``ws(s)://``) + room -> the room's relay WebSocket URL."""
    base = server.rstrip("/")
    if base.startswith("http://"):
        base = "ws://" + base[7:]
    elif base.startswith("https://"):
        base = "wss://" + base[8:]
    return f"{base}/api/rooms/{room}/ws"
