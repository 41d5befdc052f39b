"""The server end of WebRTC star links: a rank that picks ``--link rtc`` in a star room offers a
data channel to the server (``signal`` with ``to == 0`` on its WebSocket); this module answers
with aiortc and feeds the channel into the same relay as the WebSocket links.

Inbound chunks go to :meth:`Room.relay` exactly as WebSocket chunks do (the routing header's
sender must be the link's id). Outbound, a chunk cut for the sender's link can be larger than
the receiver's channel takes (its offer's ``a=max-message-size``, RFC 8841 section 6; 16 or
64 KiB in some browsers): :meth:`RtcLink.fit` re-cuts it by its routing header
(:func:`tabcohort.wire.rechunk`, no payload decode) into the receiver's size, on the channel
and on the WebSocket fallback alike, so a frame's chunks stay one consistent frame whichever
path each takes. The socket writer in ``app.py`` sends chunks on the channel while it is open (:meth:`RtcLink.send`, flow-controlled on ``bufferedAmount``: the chunks
wait in the peer's relay queue, so relay pressure and the slow-consumer bound work unchanged),
and controls on the WebSocket. When the channel closes the link falls back to the WebSocket.

Offers are untrusted too: one negotiation at a time per rank, at most ``OFFERS_PER_S`` offers
per second per rank (burst ``OFFER_BURST``; more are dropped, ``rtc_offer_busy`` /
``rtc_offer_rate``), and a failed negotiation is counted (``rtc_failed``) and logged at most once
per ``LOG_INTERVAL_S`` with the number of failures since (300 bad offers make one line, not 300).

aiortc is imported lazily: a server without WebRTC star ranks never needs it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Sequence

from tabcohort.bus.rtc_util import MAX_REMOTE_CANDIDATES, add_candidate, configuration, parse_candidate, set_host_addresses
from tabcohort.errors import ConfigError, RemoteProtocolError
from tabcohort.wire.chunk import (DATA_CHANNEL_MAX_MESSAGE_BYTES, MIN_MESSAGE_BYTES, negotiate_max_message_bytes,
                                  rechunk)

from .fairness import TokenBucket
from .rooms import Peer, Room

log = logging.getLogger("tabcohort.server.rtc")

#: Outbound flow control on the server's channel to one rank.
HIGH_WATER_BYTES = 1 << 20
LOW_WATER_BYTES = 256 << 10
#: Offers one rank may make (a renegotiation after a failed link is normal; 300 is not).
OFFERS_PER_S = 1.0
OFFER_BURST = 5
#: At most one warning per this many seconds for failed negotiations (the rest are counted).
LOG_INTERVAL_S = 60.0


class RateLimitedLog:
    """Log a warning at most once per ``interval_s``; the next one says how many were held back.

    Args:
        logger: where to log.
        interval_s: seconds between two warnings.
        clock: seconds (``time.monotonic``).
    """

    def __init__(self, logger: logging.Logger, interval_s: float = LOG_INTERVAL_S, clock: Any = time.monotonic) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._last: float | None = None
        self.n_held = 0

    def warning(self, msg: str, *args: Any) -> None:
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            self.n_held += 1
            return
        if self.n_held:
            msg += f" (and {self.n_held} more like it in the last {self.interval_s:g} s)"
        self.logger.warning(msg, *args)
        self._last, self.n_held = now, 0


class RtcLink:
    """One rank's data channel to the server.

    Attributes:
        max_message_bytes: the largest message the rank's channel takes, bytes (the smaller of
            ours and its offer's ``a=max-message-size``; ``None`` until the offer is read).
    """

    def __init__(self, peer: Peer, on_drop: Any = None) -> None:
        self.peer = peer
        self.max_message_bytes: int | None = None
        self.on_drop = on_drop
        self.pc: Any = None
        self.channel: Any = None
        self.up = False
        self.bytes_in = 0
        self.bytes_out = 0
        self.answering = False      # a negotiation for this link is in progress
        self.n_candidates = 0       # remote candidates taken (rtc_util.MAX_REMOTE_CANDIDATES)
        self._low = asyncio.Event()
        self._low.set()

    def fit(self, chunk: bytes) -> list[bytes]:
        """The chunks to send this rank in place of ``chunk``: re-cut to ``max_message_bytes``
        by the routing header when its frame was cut larger (:func:`tabcohort.wire.rechunk`).
        A chunk that cannot be re-cut (not cut as a writer cuts) is dropped and counted."""
        m = self.max_message_bytes
        if m is None:
            return [chunk]
        try:
            return rechunk(chunk, m)
        except RemoteProtocolError as e:
            if self.on_drop is not None:
                self.on_drop(f"rechunk_{e.reason}")
            return []

    async def send(self, chunk: bytes) -> bool:
        """Send one chunk on the channel, waiting (bounded by the channel closing) for room.

        Returns:
            False if the channel is gone (the caller sends on the WebSocket instead).
        """
        ch = self.channel
        while self.up and ch is not None and ch.bufferedAmount >= HIGH_WATER_BYTES:
            self._low.clear()
            try:
                await asyncio.wait_for(self._low.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        if not self.up or ch is None or ch.readyState != "open":
            return False
        ch.send(chunk)
        self.bytes_out += len(chunk)
        return True

    def close(self) -> Any:
        self.up = False
        self._low.set()
        pc, self.pc, self.channel = self.pc, None, None
        return pc.close() if pc is not None else None


def _offered_max_message_bytes(sdp: str) -> int:
    """The chunk limit towards a rank: the smaller of ours (256 KiB) and its offer's
    ``a=max-message-size`` (RFC 8841 section 6: absent -> 64 KiB, 0 -> no limit)."""
    remote = None
    for line in sdp.splitlines():
        if line.startswith("a=max-message-size:"):
            try:
                remote = int(line.split(":", 1)[1].strip())
            except ValueError:
                remote = None
            break
    try:
        return negotiate_max_message_bytes(DATA_CHANNEL_MAX_MESSAGE_BYTES, remote)
    except ConfigError:  # below the minimum: the smallest we cut
        return MIN_MESSAGE_BYTES


class RtcTerminator:
    """Answers ``signal``s addressed to the server for every room of one app.

    Args:
        ice_servers: STUN/TURN URLs (none by default).
        host_addresses: ICE host addresses (``None`` = aioice's list; see ``rtc_util``).
    """

    def __init__(self, ice_servers: Sequence[str] = (), host_addresses: Sequence[str] | None = None) -> None:
        self.ice_servers = list(ice_servers)
        if host_addresses is not None:
            set_host_addresses(host_addresses)
        self.tasks: set[asyncio.Task] = set()
        self.failures = RateLimitedLog(log)
        self._offers: dict[int, TokenBucket] = {}     # per rank id (bounded by the seated ranks)

    def attach(self, room: Room) -> None:
        room.on_server_signal = lambda p, sig: self.on_signal(room, p, sig)

    def on_signal(self, room: Room, p: Peer, sig: dict) -> None:
        kind = sig.get("kind")
        if room.job.topology != "star":
            room.drop("no_route")
            return
        if kind == "offer" and isinstance(sig.get("sdp"), str):
            now = time.monotonic()
            bucket = self._offers.get(p.id)
            if bucket is None or p.id not in room.peers:
                for k in [k for k in self._offers if k not in room.peers]:
                    del self._offers[k]
                bucket = self._offers[p.id] = TokenBucket(OFFERS_PER_S, OFFER_BURST, now)
            if p.rtc is not None and p.rtc.answering:
                room.drop("rtc_offer_busy")
                p.charge("rtc_offer_busy")
            elif not bucket.take(1, now):
                room.drop("rtc_offer_rate")
                p.charge("rtc_offer_rate")
            else:
                self._spawn(self._answer(room, p, sig["sdp"]), room)
        elif kind == "candidate" and isinstance(sig.get("candidate"), dict) and p.rtc is not None \
                and p.rtc.pc is not None:
            if p.rtc.n_candidates >= MAX_REMOTE_CANDIDATES:
                room.drop("rtc_candidate_limit")
                p.charge("rtc_candidate_limit")
                return
            p.rtc.n_candidates += 1
            try:
                cand = parse_candidate(sig["candidate"])
            except ValueError:
                room.drop("bad_signal")
                p.charge("bad_signal")
                return
            self._spawn(add_candidate(p.rtc.pc, cand), room)
        elif kind == "bye":
            self.detach(p)
        else:
            room.drop("bad_signal")

    def detach(self, p: Peer) -> None:
        """The rank's socket ended (or it gave up): close its channel."""
        link, p.rtc = p.rtc, None
        if link is not None:
            c = link.close()
            if c is not None:
                self._spawn(c)

    def _spawn(self, coro: Any, room: Room | None = None) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(lambda t: self._done(t, room))

    def _done(self, t: asyncio.Task, room: Room | None) -> None:
        self.tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            if room is not None:
                room.drop("rtc_failed")
            self.failures.warning("rtc link task failed: %r", t.exception())

    async def _answer(self, room: Room, p: Peer, sdp: str) -> None:
        self.detach(p)
        link = p.rtc = RtcLink(p, on_drop=room.drop)
        link.max_message_bytes = _offered_max_message_bytes(sdp)
        link.answering = True
        try:
            await self._negotiate(room, p, link, sdp)
        except Exception:
            if p.rtc is not link:      # superseded (a newer offer, or the rank left): not a failure
                return
            self.detach(p)
            raise
        finally:
            link.answering = False

    async def _negotiate(self, room: Room, p: Peer, link: RtcLink, sdp: str) -> None:
        from aiortc import RTCPeerConnection, RTCSessionDescription

        pc = link.pc = RTCPeerConnection(configuration(self.ice_servers))

        @pc.on("datachannel")
        def _channel(ch: Any) -> None:
            if p.rtc is not link:
                ch.close()
                return
            link.channel = ch
            ch.bufferedAmountLowThreshold = LOW_WATER_BYTES

            def opened() -> None:
                link.up = True
                log.info("rank %08x: WebRTC star link open", p.id)
                if p.wake is not None:
                    p.wake()

            @ch.on("message")
            def _message(data: Any) -> None:
                if isinstance(data, (bytes, bytearray)) and p.connected and p.rtc is link:
                    link.bytes_in += len(data)
                    room.relay(p, bytes(data))

            @ch.on("bufferedamountlow")
            def _low() -> None:
                link._low.set()

            @ch.on("close")
            def _closed() -> None:
                link.up = False
                link._low.set()

            if ch.readyState == "open":
                opened()
            else:
                ch.on("open", opened)

        @pc.on("connectionstatechange")
        def _state() -> None:
            if pc.connectionState in ("failed", "closed"):
                link.up = False
                link._low.set()

        await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
        await pc.setLocalDescription(await pc.createAnswer())
        if p.rtc is link and p.connected:
            room.send_control(p, {"type": "signal", "from": 0, "kind": "answer", "sdp": pc.localDescription.sdp})

    async def aclose(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=2.0)
