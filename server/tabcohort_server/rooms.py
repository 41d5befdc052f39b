"""Room bookkeeping as plain Python (no aiohttp): ids, the star relay's routing and queues,
state reports, stop conditions and counters. The aiohttp layer (app.py) owns the sockets and
calls in here; this module tells it whom to wake (``Peer.wake``) and whom to drop
(``Peer.kick``).

Relay rules (README "Server, native ranks and tabs" and "Limits"): each chunk is routed by its
routing header (:func:`tabcohort.wire.parse_route`) without decoding the payload; a chunk whose
``from`` disagrees with the link's bound id is dropped (``spoofed``). Each link may send at most
``sender_max_msgs_per_s`` messages and ``sender_max_bytes_per_s`` bytes per second (token
buckets); beyond that its messages are dropped (``rate_limited``) and a link that keeps on is
closed (4029). Each receiver's queue holds one FIFO per sender, served round-robin with the
server's controls first (:class:`~.fairness.FairQueue`); when a receiver's queue is full the
sender holding the most of it loses its newest items there (``fair_share``: the rest of that frame
is dropped for that receiver too), so one sender's flood never closes another rank. A receiver is
a slow consumer (closed 4008) only when one write to it has not completed for ``write_stall_s``
or its queue is full of the server's own controls: what it reads, not what others send.

Control messages (text) are validated by :mod:`.schema` before a field is read; invalid ones are
dropped and counted by reason. The room's step and stop conditions trust the report of the rank
most connected ranks name as their leader (:meth:`Room.leader_report`), never the highest claim.
"""

from __future__ import annotations

import json
import math
import random
import hashlib
import heapq
import hmac
import secrets
import struct
import time
from collections import Counter
from typing import Any, Callable

from tabcohort.errors import RemoteProtocolError
from tabcohort.wire import WireLimits, parse_route

from .config import JobConfig, ServerLimits
from .fairness import SERVER, FairQueue, TokenBucket
from .schema import parse_control

#: WebSocket close codes (application range 4000-4999) with their reasons.
CLOSE_BAD_REGISTER = 4000
CLOSE_BAD_TOKEN = 4001
CLOSE_UNKNOWN_ID = 4004
CLOSE_SLOW_CONSUMER = 4008
CLOSE_ROOM_FULL = 4009
CLOSE_REPLACED = 4010
#: registrations over the server's admission rate (``ServerLimits.register_rate_per_s``) or a
#: link over its send rate: the client backs off (full jitter) and tries again; as HTTP's 429
#: Too Many Requests (RFC 6585)
CLOSE_RETRY_LATER = 4029
CLOSE_RATE_LIMITED = CLOSE_RETRY_LATER
CLOSE_ADDRESS_FULL = 4011

#: A room whose leader keeps refusing overflowing updates this long without a step is stopped
#: as diverged (the parameters stay the last finite ones; retrying the same update never helps).
DIVERGED_AFTER_S = 5.0

#: Report fields kept from a rank's state report (anything else is ignored).
REPORT_FIELDS = ("id", "leader", "is_leader", "ready", "running", "joining", "step", "cohort", "loss",
                 "accuracy", "steps_per_s", "samples_per_s", "wire_bytes_per_s", "bucket_len",
                 "batch", "model", "backend", "precision", "lr", "fault", "policy", "digest", "pid",
                 "leaders", "first_loss", "start_step", "final", "wire_drops", "links", "link_bytes",
                 "counters", "gaps", "drops", "transport", "rejoins",
                 "term", "members", "majority", "diverged", "global_batch", "samples_assigned", "epoch",
                 "shares", "speeds", "applied", "flaps", "probation", "round_gaps", "kind")
#: Report fields shown only to the operator (``/api/rooms/ROOM`` with the operator token).
OPERATOR_FIELDS = ("pid",)
#: Offset of ``frame_id`` in a chunk's routing header (``tabcohort.wire``: u8 version, u8 flags,
#: u32 sender, u32 recipient, u32 frame_id, ...).
_FRAME_ID = struct.Struct("<I")
_FRAME_ID_AT = 10


class RoomError(Exception):
    """A registration the room refuses; ``code`` and ``reason`` become the close frame."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class Peer:
    """One rank's seat in a room: its id, resume secret, relay queue and last report."""

    def __init__(self, rank_id: int, secret: str, address: str | None = None) -> None:
        self.id = rank_id
        self.secret = secret
        self.address = address     # the client's network address (per-address seat bound)
        self.connected = False
        self.disconnected_at: float | None = None
        self.queue = FairQueue()
        #: ingress token buckets (messages, bytes) and the strike bucket that closes a link
        #: that keeps sending over its rate (set at each connect)
        self.msg_bucket: TokenBucket | None = None
        self.byte_bucket: TokenBucket | None = None
        self.strikes: TokenBucket | None = None
        #: per sender: the frame id whose remaining chunks are dropped for this receiver
        #: (a chunk of it was shed: the rest cannot complete)
        self.skip: dict[int, int] = {}
        #: when the socket layer began the write in progress (``None`` = idle); seconds
        self.write_since: float | None = None
        #: what this rank's own traffic cost it: drops charged to it as a sender, by reason
        self.charged: dict[str, int] = {}
        #: bytes this rank took off its link but has not consumed (``backlog`` control: a tab,
        #: whose page cannot pause reading a socket, reports what its stalled worker holds);
        #: counted with the relay queue in the room's pressure, as unread socket bytes would be
        self.rx_backlog = 0
        self.load_version = 0      # bumps at every change of queued_bytes + rx_backlog (Room._loads)
        self.n_in = 0              # messages received from this rank (chunks + controls)
        self.n_out = 0             # messages written to this rank's socket
        self.bytes_out = 0
        self.report: dict | None = None
        self.report_at: float | None = None
        #: mesh rooms: the peers this rank reaches through the relay (``relay_peers`` control);
        #: its broadcast chunks are relayed to those only (the others get them on a channel).
        self.relay_peers: set[int] = set()
        #: star rooms: the rank's WebRTC link, when it has one (set by rtc_relay); ``None`` = ws.
        self.rtc: Any = None
        #: set by the socket layer: wake the writer / close the socket with (code, reason)
        self.wake: Callable[[], None] | None = None
        self.kick: Callable[[int, str], None] | None = None

    @property
    def queued_bytes(self) -> int:
        return self.queue.n_bytes

    def pop(self) -> bytes | str:
        return self.queue.pop()

    def charge(self, reason: str, n: int = 1) -> None:
        self.charged[reason] = self.charged.get(reason, 0) + n


class Room:
    """One room: a job and the ranks training it over the star relay.

    Args:
        name: the room name.
        job: the job configuration.
        limits: server limits (queue bounds, room size, grace).
        rng: source of rank ids and resume secrets.
    """

    def __init__(self, name: str, job: JobConfig, limits: ServerLimits,
                 rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.clock = clock
        self.job = job
        self.limits = limits
        self.rng = rng or random.SystemRandom()
        self.wire_limits = WireLimits()
        self.peers: dict[int, Peer] = {}        # connected and reserved
        self.connected: dict[int, Peer] = {}
        self.frames_in = 0
        self.bytes_in = 0
        self.frames_relayed = 0
        self.bytes_relayed = 0
        self.drops: dict[str, int] = {}
        self.started_at: float | None = None
        self.stopped = False
        self.stop_reason: str | None = None
        self.checkpoint: dict | None = None     # meta of the latest checkpoint
        self.resumed_from_step: int | None = None   # the checkpoint's step when the server started on it
        #: resume secrets are HMAC(secret_key, room:id) when set (the app sets it; it persists in
        #: the checkpoint directory), so a restarted server re-seats a rank that resumes with its
        #: id and secret although it never issued that id; ids released here are never re-seated.
        self.secret_key: bytes | None = None
        self._released: set[int] = set()
        self._diverging: tuple[float, float, float] | None = None   # (since, step, diverged count)
        self._pressure_sent = 0.0
        self._in_pressure = False
        #: max-heap of (-(queued + backlog), version, id), stale entries dropped lazily: the max
        #: load in O(log n) per relayed frame instead of a scan of every rank (200-rank profile)
        self._loads: list[tuple[int, int, int]] = []
        #: the trusted leader's last step (``step()``); never the highest claim
        self._trusted_step = 0

    # ------------------------------------------------------------------ membership
    def seats_of(self, address: str | None) -> int:
        """Seats (connected and reserved) held from ``address``."""
        return 0 if address is None else sum(1 for q in self.peers.values() if q.address == address)

    def _check_address(self, address: str | None, now: float) -> None:
        cap = self.limits.max_ranks_per_address
        if address is not None and self.seats_of(address) >= cap:
            self.expire(now)
            if self.seats_of(address) >= cap:
                raise RoomError(CLOSE_ADDRESS_FULL, f"too many ranks from one address ({cap}; "
                                                    f"the operator can raise --max-ranks-per-address)")

    def register(self, *, now: float, resume_id: int | None = None, resume_secret: str | None = None,
                 address: str | None = None) -> Peer:
        """Seat a rank: a fresh random uint32 id, or its old id when resuming within grace.

        Args:
            address: the client's network address; at most ``limits.max_ranks_per_address``
                seats (connected or reserved) per address (``None``: not bounded).

        Raises:
            RoomError: room full, too many seats from the address, or a resume with an unknown
                id or wrong secret.
        """
        if resume_id is not None:
            p = self.peers.get(resume_id)
            if p is None and self._adoptable(resume_id, resume_secret):
                if len(self.peers) >= self.limits.max_ranks_per_room:
                    raise RoomError(CLOSE_ROOM_FULL, f"room full ({self.limits.max_ranks_per_room} ranks)")
                self._check_address(address, now)
                p = self.peers[resume_id] = Peer(resume_id, self._secret(resume_id), address)
            if p is None or not isinstance(resume_secret, str) or not secrets.compare_digest(
                    p.secret, resume_secret):
                raise RoomError(CLOSE_UNKNOWN_ID, "unknown rank id or secret (grace expired, or the server "
                                                 "restarted without its checkpoint dir?)")
            if p.connected:  # the old socket is half-dead: the new one replaces it
                self._disconnect(p, now, reason=(CLOSE_REPLACED, "replaced by a newer connection"))
        else:
            if len(self.peers) >= self.limits.max_ranks_per_room:
                self.expire(now)
                if len(self.peers) >= self.limits.max_ranks_per_room:
                    raise RoomError(CLOSE_ROOM_FULL, f"room full ({self.limits.max_ranks_per_room} ranks)")
            self._check_address(address, now)
            while True:
                k = self.rng.getrandbits(32)
                if k not in self.peers and k != 0:
                    break
            p = self.peers[k] = Peer(k, self._secret(k), address)
        p.connected = True
        p.disconnected_at = None
        lim = self.limits
        p.msg_bucket = TokenBucket(lim.sender_max_msgs_per_s, 2 * lim.sender_max_msgs_per_s, now)
        p.byte_bucket = TokenBucket(lim.sender_max_bytes_per_s, lim.sender_max_bytes_per_s, now)
        # excess messages a link may send before it is closed: rate_limit_close_s seconds' worth
        # of its rate, refilled at a quarter of its rate (a sender persistently over 1.25x its
        # rate is closed; one that bursts over now and then only loses the excess)
        p.strikes = TokenBucket(lim.sender_max_msgs_per_s / 4,
                                lim.sender_max_msgs_per_s * lim.rate_limit_close_s, now)
        p.skip.clear()
        p.write_since = None
        self.connected[p.id] = p
        if self.started_at is None:
            self.started_at = now
        return p

    def _secret(self, k: int) -> str:
        if self.secret_key is None:
            return "%032x" % self.rng.getrandbits(128)
        return hmac.new(self.secret_key, f"{self.name}:{k}".encode(), hashlib.sha256).hexdigest()[:32]

    def _adoptable(self, k: int, secret: object) -> bool:
        """A resume for an id this process never seated (the server restarted) with a valid secret."""
        return (self.secret_key is not None and isinstance(secret, str) and 0 < k < 1 << 32
                and k not in self._released and secrets.compare_digest(self._secret(k), secret))

    def welcome(self, p: Peer, *, resumed: bool) -> dict:
        return {"type": "welcome", "id": p.id, "secret": p.secret, "room": self.name,
                "topology": self.job.topology,
                "resumed": resumed, "stopped": self.stopped,
                "peers": sorted(k for k in self.connected if k != p.id),
                "high_water_bytes": self.limits.queue_high_water_bytes,
                "max_message_bytes": self.limits.max_ws_message_bytes}

    def announce(self, p: Peer, up: bool) -> None:
        """Tell the other connected ranks that ``p`` joined or left the relay."""
        self.broadcast_control({"type": "peer", "id": p.id, "up": up}, exclude=p.id)

    def disconnect(self, p: Peer, now: float) -> None:
        """The socket of ``p`` ended; its id stays reserved for ``resume_grace_s``."""
        if p.connected and self.connected.get(p.id) is p:
            self._disconnect(p, now)

    def _disconnect(self, p: Peer, now: float, reason: tuple[int, str] | None = None) -> None:
        p.connected = False
        p.disconnected_at = now
        self.connected.pop(p.id, None)
        p.relay_peers = set()
        p.queue.clear()
        p.skip.clear()
        p.write_since = None
        p.rx_backlog = 0
        p.load_version += 1
        kick, p.kick, p.wake = p.kick, None, None
        if reason is not None and kick is not None:
            kick(*reason)
        self.announce(p, False)
        self._update_pressure()

    def expire(self, now: float) -> list[int]:
        """Release the ids of ranks disconnected longer than the grace period."""
        gone = [k for k, p in self.peers.items()
                if not p.connected and p.disconnected_at is not None
                and now - p.disconnected_at > self.limits.resume_grace_s]
        for k in gone:
            del self.peers[k]
            self._released.add(k)
        return gone

    # ------------------------------------------------------------------ relay
    def drop(self, reason: str, n: int = 1) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + n

    def admit(self, sender: Peer, n_bytes: int, now: float | None = None) -> bool:
        """Charge one message of ``n_bytes`` from ``sender``'s link to its rate limits.

        Returns False (the message is dropped, ``rate_limited``) when the link is over its rate;
        a link that keeps sending over its rate (its strike bucket, ``rate_limit_close_s``
        seconds' worth of excess messages, runs dry) is closed with 4029.
        """
        if sender.msg_bucket is None or not sender.connected:
            return sender.connected
        now = self.clock() if now is None else now
        if sender.msg_bucket.take(1, now) and sender.byte_bucket.take(min(n_bytes, sender.byte_bucket.burst), now):
            return True
        self.drop("rate_limited")
        sender.charge("rate_limited")
        if not sender.strikes.take(1, now):
            self.drop("rate_limit_close")
            self._disconnect(sender, now, reason=(CLOSE_RATE_LIMITED, "sending over the rate limit"))
        return False

    def relay(self, sender: Peer, chunk: bytes) -> None:
        """Route one chunk from ``sender``'s link by its header; never decodes the payload."""
        sender.n_in += 1
        self.frames_in += 1
        self.bytes_in += len(chunk)
        if not self.admit(sender, len(chunk)):
            return
        try:
            r = parse_route(chunk, self.wire_limits)
        except RemoteProtocolError as e:
            self.drop(e.reason)
            return
        if r.sender != sender.id:
            self.drop("spoofed")
            return
        if r.recipient is not None:
            p = self.connected.get(r.recipient)
            if p is None or p is sender:
                self.drop("no_route")
                return
            self._enqueue(p, chunk, sender, r.frame_id)
        else:
            mesh = self.job.topology == "mesh"
            for p in list(self.connected.values()):
                if p is not sender and (not mesh or p.id in sender.relay_peers):
                    self._enqueue(p, chunk, sender, r.frame_id)
        self._update_pressure()

    def _shed(self, p: Peer, src: Peer | None, frame_id: int | None) -> None:
        """Count one item dropped for ``p`` because its sender held the most of ``p``'s queue."""
        self.drop("fair_share")
        if src is not None:
            src.charge("fair_share")
            if frame_id is not None:
                p.skip[src.id] = frame_id

    def _enqueue(self, p: Peer, item: bytes | str, src: Peer | None = None, frame_id: int | None = None) -> None:
        """Queue ``item`` for ``p``: from ``src`` (a rank; ``None`` = the server's control).

        When ``p``'s queue is full, the sender holding the most of it (bytes or items, whichever
        bound is hit; never the server) loses its newest items there until ``item`` fits, or
        ``item`` itself when that sender is ``src`` (``fair_share``). A queue full of the
        server's controls alone is a slow consumer (4008).
        """
        if not p.connected:
            return
        key = SERVER if src is None else src.id
        if src is not None and frame_id is not None and p.skip.get(key) == frame_id:
            self.drop("fair_share")     # the rest of a frame already shed for p
            src.charge("fair_share")
            return
        n = len(item)
        lim = self.limits
        q = p.queue
        while q.n_bytes + n > lim.queue_max_bytes or q.n_items + 1 > lim.queue_max_items:
            by_items = q.n_items + 1 > lim.queue_max_items
            held, inc = (q.items_of, 1) if by_items else (q.bytes_of, n)
            heavy = max((s for s in q.senders() if s != SERVER), key=held, default=None)
            if src is not None and (heavy is None or held(key) + inc > held(heavy)):
                heavy = key     # with this item the sender would hold the most: it is the one shed
            if heavy is None:   # only the server's controls: p does not read
                self.drop("slow_consumer")
                self._disconnect(p, self.clock(),
                                 reason=(CLOSE_SLOW_CONSUMER, "slow consumer: relay queue over its bound"))
                return
            if heavy == key:
                self._shed(p, src, frame_id)
                return
            old = q.evict_tail(heavy)
            hp = self.peers.get(heavy)
            self._shed(p, hp, _FRAME_ID.unpack_from(old, _FRAME_ID_AT)[0]
                       if isinstance(old, bytes) and len(old) >= _FRAME_ID_AT + 4 else None)
        q.push(key, item)
        self._load_changed(p)
        if isinstance(item, bytes):
            self.frames_relayed += 1
            self.bytes_relayed += n
        if p.wake is not None:
            p.wake()

    def writing(self, p: Peer, now: float) -> None:
        """The socket layer begins writing an item to ``p`` (the write-stall clock starts)."""
        p.write_since = now

    def check_stalls(self, now: float) -> list[int]:
        """Close (4008) every rank whose write in progress began over ``write_stall_s`` ago:
        it does not read (a slow consumer), whatever the others send."""
        gone = [p for p in self.connected.values()
                if p.write_since is not None and now - p.write_since > self.limits.write_stall_s]
        for p in gone:
            self.drop("slow_consumer")
            self._disconnect(p, now, reason=(CLOSE_SLOW_CONSUMER,
                                             f"slow consumer: no write completed in {self.limits.write_stall_s:g} s"))
        return [p.id for p in gone]

    def sent(self, p: Peer, item: bytes | str) -> None:
        """The socket layer wrote ``item`` (popped from ``p.queue``, or one piece of it re-cut for
        the rank's data channel) to the socket."""
        p.write_since = None
        p.n_out += 1
        p.bytes_out += len(item)
        self._load_changed(p)
        self._update_pressure()

    def _load_changed(self, p: Peer) -> None:
        p.load_version += 1
        heapq.heappush(self._loads, (-(p.queued_bytes + p.rx_backlog), p.load_version, p.id))
        if len(self._loads) > 4 * len(self.connected) + 64:   # bound the stale entries
            self._loads = [(-(q.queued_bytes + q.rx_backlog), q.load_version, q.id) for q in self.connected.values()]
            heapq.heapify(self._loads)

    def pressure(self) -> float:
        """Max over connected ranks that are reading of (queued relay bytes + reported receive
        backlog) / high-water mark. A rank whose write in progress began over
        ``pressure_stall_s`` ago is not reading (frozen, stopped): it does not count, or one such
        rank would make every leader pace the whole room on it; its queue is shed instead."""
        now = self.clock()
        stalled: list[tuple[int, int, int]] = []
        try:
            return self._pressure(now, stalled)
        finally:
            for e in stalled:                  # they count again once their writes complete
                heapq.heappush(self._loads, e)

    def _pressure(self, now: float, stalled: list[tuple[int, int, int]]) -> float:
        loads = self._loads
        while loads:
            neg, version, k = loads[0]
            q = self.connected.get(k)
            if q is None or q.load_version != version:
                heapq.heappop(loads)           # stale: a newer entry or a gone rank
                continue
            load = q.queued_bytes + q.rx_backlog
            if q.write_since is not None and now - q.write_since > self.limits.pressure_stall_s:
                stalled.append(heapq.heappop(loads))
                continue
            if load == -neg:
                return load / self.limits.queue_high_water_bytes
            # popped since (Peer.pop lowers a load without telling the room; every rise is
            # pushed): replace the entry with the current load and look again
            heapq.heappop(loads)
            self._load_changed(q)
            loads = self._loads
        return 0.0

    def _update_pressure(self) -> None:
        """Tell every rank the relay pressure when it moved by >= 0.1, crossed 1, or went to 0."""
        if self._in_pressure:
            return
        p = round(self.pressure(), 2)
        last = self._pressure_sent
        if abs(p - last) < 0.1 and (p > 1) == (last > 1) and (p == 0) == (last == 0):
            return
        self._pressure_sent = p
        self._in_pressure = True
        try:
            self.broadcast_control({"type": "pressure", "p": p})
        finally:
            self._in_pressure = False

    def broadcast_control(self, obj: dict, exclude: int | None = None) -> None:
        text = json.dumps(obj, separators=(",", ":"))
        for p in list(self.connected.values()):
            if p.id != exclude:
                self._enqueue(p, text)

    def send_control(self, p: Peer, obj: dict, src: Peer | None = None) -> None:
        """Queue a control for ``p``: the server's own (``src=None``, served first) or one a
        rank sent (a forwarded ``signal``: queued as that rank's traffic, fairly)."""
        self._enqueue(p, json.dumps(obj, separators=(",", ":")), src)

    # ------------------------------------------------------------------ control messages
    def control(self, p: Peer, text: str, *, now: float) -> None:
        """Handle a text message from a registered rank; bad input is counted, never raised."""
        p.n_in += 1
        if not self.admit(p, len(text), now):
            return
        if len(text) > self.limits.max_control_bytes:
            self.drop("control_too_big")
            p.charge("control_too_big")
            return
        obj, why = parse_control(text)
        if obj is None:
            self.drop(why)
            p.charge(why)
            return
        t = obj["type"]
        if t == "signal":
            self.signal(p, obj)
            return
        if t == "backlog":
            p.rx_backlog = min(obj["bytes"], self.limits.queue_max_bytes)
            self._load_changed(p)
            self._update_pressure()
            return
        if t == "relay_peers":
            p.relay_peers = set(obj["ids"])
            return
        st = obj["state"]
        rep = {k: st[k] for k in REPORT_FIELDS if k in st}
        rep["id"] = p.id
        p.report = rep
        p.report_at = now
        self.check_stop(now)

    #: ``signal`` kinds the server forwards (WebRTC negotiation between two ranks).
    #: ``backlog``: a tab tells a mesh peer how many of its bytes it holds unconsumed
    SIGNAL_KINDS = ("offer", "answer", "candidate", "bye", "backlog")
    #: Set by the app when this server terminates WebRTC links (star over rtc): called with
    #: (peer, signal) for signals addressed to the server (``to == 0``).
    on_server_signal: Callable[[Peer, dict], None] | None = None

    def signal(self, p: Peer, obj: dict) -> None:
        """Forward a WebRTC ``signal`` to its recipient in this room, ``from`` bound to the link.

        ``to == 0`` addresses the server itself (the WebRTC star link). Anything else that is not
        a connected rank of this room is dropped (``no_route``); a bad message, ``bad_signal``.
        """
        to, kind = obj.get("to"), obj.get("kind")
        if isinstance(to, bool) or not isinstance(to, int) or kind not in self.SIGNAL_KINDS:
            self.drop("bad_signal")      # (parse_control checked this already; kept for callers)
            return
        fwd = {k: obj[k] for k in ("kind", "sdp", "candidate", "bytes") if k in obj}
        fwd.update(type="signal", to=to, **{"from": p.id})
        if to == 0:
            if self.on_server_signal is None:
                self.drop("no_route")
            else:
                self.on_server_signal(p, fwd)
            return
        q = self.connected.get(to)
        if q is None or q is p:
            self.drop("no_route")
            return
        self.send_control(q, fwd, src=p)

    # ------------------------------------------------------------------ state and stop
    def leader_report(self) -> dict | None:
        """The report the room trusts: that of the rank most connected ranks name as their
        leader (the ``leader`` field of their reports); on a tie, the tied leader with the lower
        step. ``None`` when no connected rank names a connected, reporting leader.

        A rank cannot make the room stop (``--steps``, ``--target-accuracy``) or show another
        step by claiming one: only a majority's leader's own report counts (PROTOCOL.md,
        "Leader": every rank of a cohort names the same leader).
        """
        votes = Counter(p.report["leader"] for p in self.connected.values()
                        if p.report and isinstance(p.report.get("leader"), int))
        if not votes:
            return None
        top = max(votes.values())
        tied = [self.connected[k].report for k, n in votes.items()
                if n == top and k in self.connected and self.connected[k].report]
        if not tied:
            return None
        return min(tied, key=lambda r: r.get("step", 0))

    def step(self) -> int:
        """The trusted leader's step (:meth:`leader_report`); while no connected rank names a
        leader, the last such step (never the highest any rank claimed)."""
        lead = self.leader_report()
        if lead is not None:
            self._trusted_step = int(lead.get("step", 0))
        return self._trusted_step

    def check_stop(self, now: float) -> bool:
        """Stop the room when its stop condition is met: tell every rank (``stop`` control)."""
        if self.stopped:
            return True
        job = self.job
        why = None
        lead = self.leader_report()
        if job.steps and self.step() >= job.steps:
            why = f"steps {job.steps} reached"
        elif job.target_accuracy and lead is not None and _num(lead.get("accuracy")) >= job.target_accuracy:
            why = f"target accuracy {job.target_accuracy} reached"
        elif job.duration_s and self.started_at is not None and now - self.started_at >= job.duration_s:
            why = f"duration {job.duration_s} s reached"
        elif lead is not None:
            why = self._diverged(lead, now)
        if why is not None:
            self.stop(why)
        return self.stopped

    def _diverged(self, lead: dict, now: float) -> str | None:
        """``diverged ...`` once the leader has refused updates that overflowed (its ``diverged``
        count rising) for ``DIVERGED_AFTER_S`` without its step advancing; else None."""
        step, n = _num(lead.get("step")), _num(lead.get("diverged"))
        since = self._diverging
        if n <= 0 or since is None or since[1] != step or since[2] > n:
            self._diverging = (now, step, n)
            return None
        if n > since[2] and now - since[0] >= DIVERGED_AFTER_S:
            return f"diverged at step {int(step)}: {str(lead.get('fault'))[:200]}"
        return None

    def stop(self, reason: str) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.stop_reason = reason
        self.broadcast_control({"type": "stop", "reason": reason})

    def rank_drops(self) -> dict[str, dict[str, int]]:
        """Drops the connected ranks report (validated reports), summed by reason:
        ``{"protocol": {...}, "wire": {...}}`` (e.g. ``pretender``, ``stale_round``,
        ``grad_non_finite``; ``reassembly_timeout``)."""
        out: dict[str, dict[str, int]] = {"protocol": {}, "wire": {}}
        for p in self.connected.values():
            if not p.report:
                continue
            for kind, key in (("protocol", "drops"), ("wire", "wire_drops")):
                for reason, n in (p.report.get(key) or {}).items():
                    out[kind][reason] = out[kind].get(reason, 0) + n
        return out

    def summary(self, now: float, *, operator: bool = False) -> dict[str, Any]:
        """The room as JSON-ready data (``GET /api/rooms/{room}``); ``operator`` adds the
        fields only the operator sees (``OPERATOR_FIELDS``: the ranks' pids)."""
        lead = self.leader_report()
        ranks = []
        for p in sorted(self.peers.values(), key=lambda p: p.id):
            rep = p.report
            if rep is not None and not operator:
                rep = {k: v for k, v in rep.items() if k not in OPERATOR_FIELDS}
            ranks.append({"id": p.id, "id_hex": f"{p.id:08x}", "connected": p.connected,
                          "link": "rtc" if p.rtc is not None and p.rtc.up else "ws",
                          "queued_bytes": p.queued_bytes, "charged": dict(p.charged),
                          "report_age_s": None if p.report_at is None else round(now - p.report_at, 3),
                          "report": rep})
        return {"room": self.name, "topology": self.job.topology,
                "link": "rtc" if self.job.topology == "mesh" else "ws",
                "n_connected": len(self.connected), "n_reserved": len(self.peers) - len(self.connected),
                "step": self.step(), "leader": None if lead is None else lead.get("leader"),
                "loss": None if lead is None else _json_num(lead.get("loss")),
                "accuracy": None if lead is None else _json_num(lead.get("accuracy")),
                "term": None if lead is None else _json_int(lead.get("term")),
                "diverged": None if lead is None else _json_int(lead.get("diverged")),
                "stopped": self.stopped, "stop_reason": self.stop_reason,
                "resumed_from_step": self.resumed_from_step,
                "checkpoint": self.checkpoint, "pressure": round(self.pressure(), 3),
                "counters": {"frames_in": self.frames_in, "bytes_in": self.bytes_in,
                             "frames_relayed": self.frames_relayed, "bytes_relayed": self.bytes_relayed},
                "drops": dict(self.drops), "rank_drops": self.rank_drops(), "ranks": ranks}


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return -math.inf
    return float(v)


def _json_num(v: Any) -> float | None:
    x = _num(v)
    return None if x == -math.inf else x


def _json_int(v: Any) -> int | None:
    x = _num(v)
    return None if x == -math.inf else int(x)


class RoomRegistry:
    """All rooms of one server, and its admission rate limit for registrations (every room's
    registrations and resumes draw on one bucket: ``ServerLimits.register_rate_per_s`` and
    ``register_burst``)."""

    def __init__(self, jobs: dict[str, JobConfig], limits: ServerLimits, seed: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        rng = random.Random(seed) if seed is not None else random.SystemRandom()
        self.rooms = {name: Room(name, job, limits, rng, clock) for name, job in jobs.items()}
        self.admission = TokenBucket(limits.register_rate_per_s, limits.register_burst, time.monotonic())

    def get(self, name: str) -> Room | None:
        return self.rooms.get(name)

    def tick(self, now: float) -> None:
        """Periodic work: release expired ids, check duration stop conditions."""
        for room in self.rooms.values():
            room.expire(now)
            room.check_stalls(now)
            room.check_stop(now)
