"""Tab transport adapters (Pyodide in a dedicated Web Worker): the page's WebSocket and the
page's ``RTCPeerConnection`` s, driven from the worker, and the factories that compose them into
the star and mesh buses (docs/INTERFACES.md, "Bus").

A Web Worker cannot hold the page's RTCPeerConnections, and the page owns the sockets so that a
UI can show them; the rank's Python runs in the worker. The two talk with ``postMessage``
(``web/app.js`` is the page side):

- worker -> page: ``{k: "ws-open", link, url}``, ``{k: "send", link, data: [ArrayBuffer...]}``
  (the chunks of one frame, transferred, not copied), ``{k: "send-text", link, text}``,
  ``{k: "ws-close", link}``; ``{k: "rtc-open", link, peer, gen, offer, ice, low_water, sdp?}``
  (``offer``: this side creates the channel and offers; else ``sdp`` is the remote offer to
  answer), ``{k: "rtc-signal", link, peer, gen, signal}`` (a remote answer or candidate),
  ``{k: "rtc-send", link, peer, gen, data: [ArrayBuffer...]}``, ``{k: "rtc-close", link, peer, gen}``;
- page -> worker: ``{k: "ws-opened", link}``, ``{k: "ws-chunk", link, data}`` (transferred),
  ``{k: "ws-text", link, text}``, ``{k: "ws-closed", link, code, reason}``, ``{k: "ack", link,
  bytes, buffered}`` (after each send: bytes handed to the socket, and its ``bufferedAmount``;
  repeated while it drains); ``rtc-local`` (``text``: a signal to forward to the peer, JSON),
  ``rtc-up`` (``bytes``: the negotiated max message size), ``rtc-chunk`` (``data``),
  ``rtc-ack`` (``bytes`` put on the channel, its ``buffered`` amount), ``rtc-down``
  (``reason``); ``conflated`` (``via``, ``peer``, ``gen``, ``sender``, ``frames``, ``chunks``,
  ``bytes``: superseded round frames the worker dropped unread, ``tcConflate``; counted as
  received and as ``round_superseded``, and the hub pauses :data:`CATCH_UP_PAUSE_S` after a take
  that held one); anything without a ``link`` goes to the hub's ``on_other`` (UI controls).
  ``gen`` numbers each peer connection so that events of a replaced one are ignored (counted as
  ``stale_link_event``). The page offers and answers with complete SDP (it waits for ICE
  gathering, bounded), so aiortc (which does not trickle) and tabs interoperate.

The worker's ``onmessage`` (``web/rank-worker.js``) only appends to an inbox and calls one
Python wake-up; :class:`PortHub` drains the whole inbox per wake-up (an await of a JS promise
costs 150-270 us in Pyodide, so never one await per message).

Neither the page's socket nor its data channels can stop reading: both adapters have
``can_pause = False``, so a stalled bus holds what arrives and reports it as ``backlog``.

``js`` and ``pyodide.ffi`` are imported lazily (inside :class:`JsPort`), so this module imports
natively too; tests can pass any port with the same methods.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable

from ..wire import DEFAULT_MAX_MESSAGE_BYTES
from ..wire.codecs import DEFAULT_INT8_BLOCK
from .mesh import MeshBus
from .rtc_util import ice_server_dicts, parse_ice_servers
from .star import ChannelListener, SocketListener, StarBus

log = logging.getLogger("tabcohort.bus.page")

#: a follower that fell behind the round rate waits this long between takes of the page inbox
#: (PortHub), so it follows at most ~20 rounds/s instead of spending a core on rounds it skips
CATCH_UP_PAUSE_S = 0.05


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
                        "peer", "gen", "via", "sender", "frames", "chunks"):
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
        port: a :class:`JsPort` (or an object with the same methods).
        on_other: called with every message that is not for a link (UI controls).
    """

    def __init__(self, port: Any, on_other: Callable[[dict], None] | None = None) -> None:
        self.port = port
        self.on_other = on_other
        self.links: dict[int, Any] = {}
        self._next_link = 1
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.n_wakeups = 0
        self.n_items = 0
        #: after a take in which superseded rounds were dropped, wait this long before the next
        #: (PROTOCOL.md, "Follower: receiving messages": superseded rounds)
        self.catch_up_pause_s = CATCH_UP_PAUSE_S
        self.n_catch_up_pauses = 0

    def start(self) -> "PortHub":
        self.port.set_wake(self._wake.set)
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def new_link(self, handler: Any) -> int:
        """A link id whose page messages go to ``handler.on_port(item)``."""
        k = self._next_link
        self._next_link += 1
        self.links[k] = handler
        return k

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            items = self.port.take()
            self.n_wakeups += 1
            self.n_items += len(items)
            behind = False
            for it in items:
                behind = behind or it.get("k") == "conflated"
                h = self.links.get(it.get("link")) if "link" in it else None
                try:
                    if h is not None:
                        h.on_port(it)
                    elif "link" not in it and self.on_other is not None:
                        self.on_other(it)
                except Exception:
                    log.exception("handling page message %r failed", it.get("k"))
            if behind:
                # the rounds arrive faster than this rank can follow them: let them pile up in
                # the worker's inbox, where all but the newest are dropped unread (tcConflate),
                # instead of waking for every one; timers (the heartbeat) run meanwhile
                self.n_catch_up_pauses += 1
                await asyncio.sleep(self.catch_up_pause_s)

    async def aclose(self) -> None:
        for h in list(self.links.values()):
            h.close()
        self.links.clear()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.port.set_wake(None)


class PageSocket:
    """The page's WebSocket to the server, as a socket adapter (:class:`tabcohort.bus.star.Socket`).

    ``queued_bytes`` is what the page has not put on the wire as far as the worker knows: bytes
    handed to the page and not yet acknowledged, plus the socket's ``bufferedAmount`` at the last
    acknowledgement.
    """

    can_pause = False

    def __init__(self, hub: PortHub) -> None:
        self.hub = hub
        self.link = hub.new_link(self)
        self.listener: SocketListener | None = None
        self.unacked = 0
        self.buffered = 0

    def open(self, url: str, listener: SocketListener) -> None:
        self.listener = listener
        self.hub.port.open(self.link, url)

    def send_chunks(self, chunks: list[bytes]) -> None:
        self.unacked += sum(map(len, chunks))
        self.hub.port.send_chunks(self.link, chunks)

    def send_text(self, text: str) -> None:
        self.unacked += len(text)
        self.hub.port.send_text(self.link, text)

    def queued_bytes(self) -> int:
        return self.unacked + self.buffered

    def discard(self) -> int:
        self.unacked = self.buffered = 0
        return 0

    def pause(self, paused: bool) -> None:
        pass   # the page cannot stop reading its socket (can_pause is False)

    def close(self) -> None:
        self.listener = None
        self.hub.port.close(self.link)

    async def aclose(self) -> None:
        self.close()
        self.hub.links.pop(self.link, None)

    def on_port(self, it: dict) -> None:
        k, ls = it.get("k"), self.listener
        if k == "ack":
            self.unacked = max(0, self.unacked - int(it.get("bytes", 0)))
            self.buffered = int(it.get("buffered", 0))
        elif ls is None:
            return
        elif k == "ws-chunk":
            ls.on_chunk(it["data"])
        elif k == "ws-text":
            ls.on_text(it.get("text", ""))
        elif k == "conflated":   # superseded rounds the worker dropped unread (tcConflate)
            ls.on_conflated(it.get("sender"), *_conflated_counts(it))
        elif k == "ws-opened":
            ls.on_open()
        elif k == "ws-closed":
            self.unacked = self.buffered = 0
            ls.on_closed(int(it.get("code", 1006)), str(it.get("reason", "")))


class PageChannel:
    """The worker's view of one page-owned ``RTCDataChannel`` (one generation of one pair).

    ``buffered_bytes`` is bytes handed to the page and not yet acknowledged plus the channel's
    ``bufferedAmount`` at the last acknowledgement (as for :class:`PageSocket`).
    """

    def __init__(self, connector: "PageConnector", peer: int, gen: int, listener: ChannelListener) -> None:
        self.connector, self.peer, self.gen, self.listener = connector, peer, gen, listener
        self.unacked = 0
        self.page_buffered = 0
        self.closed = False

    def buffered_bytes(self) -> int:
        return self.unacked + self.page_buffered

    def send(self, chunks: list[bytes]) -> bool:
        self.unacked += sum(map(len, chunks))
        c = self.connector
        c.hub.port.rtc_send(c.link, self.peer, self.gen, chunks)
        return True

    def signal(self, signal: dict) -> None:
        c = self.connector
        c.hub.port.rtc({"k": "rtc-signal", "link": c.link, "peer": self.peer, "gen": self.gen, "signal": signal})

    def pause(self, paused: bool) -> None:
        pass   # the page cannot pause a data channel (the connector's can_pause is False)

    def idle(self) -> bool:
        return self.buffered_bytes() == 0

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            c = self.connector
            if c.channels.get(self.peer) is self:
                del c.channels[self.peer]
            c.hub.port.rtc({"k": "rtc-close", "link": c.link, "peer": self.peer, "gen": self.gen})


class PageConnector:
    """Makes :class:`PageChannel` s: the page's ``RTCPeerConnection`` s (a
    :class:`tabcohort.bus.star.Connector`).

    Args:
        hub: this worker's :class:`PortHub`.
        ice_servers: STUN/TURN URLs (``turn:user:pass@host:port``).
        channel_low_water_bytes: the page's ``bufferedAmountLowThreshold``.
    """

    can_pause = False

    def __init__(self, hub: PortHub, *, ice_servers: Any = None, channel_low_water_bytes: int = 256 << 10) -> None:
        self.hub = hub
        self.link = hub.new_link(self)
        self.ice_servers = parse_ice_servers(ice_servers)
        self.channel_low_water_bytes = channel_low_water_bytes
        self.channels: dict[int, PageChannel] = {}
        self.drops: dict[str, int] = {}
        self._gen = 0

    def check(self) -> None:
        pass

    def open(self, peer: int, listener: ChannelListener, *, offer_sdp: str | None = None) -> PageChannel:
        old = self.channels.get(peer)
        if old is not None:
            old.close()
        self._gen += 1
        ch = self.channels[peer] = PageChannel(self, peer, self._gen, listener)
        msg: dict[str, Any] = {"k": "rtc-open", "link": self.link, "peer": peer, "gen": ch.gen,
                               "offer": offer_sdp is None, "ice": ice_server_dicts(self.ice_servers),
                               "low_water": self.channel_low_water_bytes}
        if offer_sdp is not None:
            msg["sdp"] = offer_sdp
        self.hub.port.rtc(msg)
        return ch

    def close(self) -> None:
        for ch in list(self.channels.values()):
            ch.close()

    async def aclose(self) -> None:
        self.close()
        self.hub.links.pop(self.link, None)

    def _count(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1

    def on_port(self, it: dict) -> None:
        k, peer = it.get("k"), it.get("peer")
        ch = self.channels.get(peer) if isinstance(peer, int) else None
        if ch is None or it.get("gen") != ch.gen:
            self._count("stale_link_event")
            return
        ls = ch.listener
        if k == "rtc-chunk":
            ls.channel_chunk(ch, it["data"])
        elif k == "conflated":   # superseded rounds the worker dropped unread (tcConflate)
            ls.channel_conflated(ch, it.get("sender"), *_conflated_counts(it))
        elif k == "rtc-ack":
            ch.unacked = max(0, ch.unacked - int(it.get("bytes", 0)))
            ch.page_buffered = int(it.get("buffered", 0))
            ls.channel_low(ch)
        elif k == "rtc-local":
            try:
                signal = json.loads(it.get("text", ""))
            except ValueError:
                self._count("bad_signal")
                return
            if isinstance(signal, dict):
                ls.channel_signal(ch, signal)
            else:
                self._count("bad_signal")
        elif k == "rtc-up":
            ls.channel_open(ch, int(it.get("bytes") or DEFAULT_MAX_MESSAGE_BYTES))
        elif k == "rtc-down":
            ls.channel_down(ch, str(it.get("reason") or "data channel closed"))


def _conflated_counts(it: dict) -> tuple[int, int, int]:
    """``(frames, chunks, bytes)`` of a ``conflated`` page item (negative or absent -> 0)."""
    out = []
    for key in ("frames", "chunks", "bytes"):
        v = it.get(key)
        out.append(int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else 0)
    return out[0], out[1], out[2]


def page_star_bus(hub: PortHub, url: str, *, link: str = "ws", ice_servers: Any = None,
                  channel_low_water_bytes: int = 256 << 10, **kw: Any) -> StarBus:
    """A tab's star bus over the page's socket; ``link="rtc"``: chunks on a page-owned data
    channel to the server while it is open. ``kw``: as for :class:`~tabcohort.bus.star.StarBus`."""
    connector = PageConnector(hub, ice_servers=ice_servers, channel_low_water_bytes=channel_low_water_bytes) \
        if link == "rtc" else None
    return StarBus(PageSocket(hub), url, connector=connector, **kw)


def page_mesh_bus(hub: PortHub, url: str, *, ice_servers: Any = None, channel_low_water_bytes: int = 256 << 10,
                  token: str | None = None, trainer_token: str | None = None, reconnect_max_s: float = 30.0,
                  **kw: Any) -> MeshBus:
    """A tab's mesh bus: the page's peer connections, the page's socket as the relay."""
    relay = StarBus(PageSocket(hub), url, token=token, trainer_token=trainer_token,
                    reconnect_max_s=reconnect_max_s,
                    precision=kw.get("precision", "f32"), int8_block=kw.get("int8_block", DEFAULT_INT8_BLOCK),
                    use_numpy=kw.get("use_numpy"))
    return MeshBus(relay, PageConnector(hub, ice_servers=ice_servers, channel_low_water_bytes=channel_low_water_bytes),
                   **kw)
