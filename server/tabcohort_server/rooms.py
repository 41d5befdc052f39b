"""Room bookkeeping as plain Python (no aiohttp): ids, the star relay's routing and queues,
state reports, stop conditions and counters. The aiohttp layer (app.py) owns the sockets and
calls in here; this module tells it whom to wake (``Peer.wake``) and whom to drop
(``Peer.kick``).

Relay rules (docs/INTERFACES.md, "Bus"; README, "Server, native ranks and tabs"): each chunk is routed by its routing header
(:func:`tabcohort.wire.parse_route`) without decoding the payload; a chunk whose ``from``
disagrees with the link's bound id is dropped (``spoofed``); a peer whose queue exceeds its
bounds is dropped (``slow_consumer``) instead of blocking the others.
"""

from __future__ import annotations

import json
import math
import random
import hashlib
import heapq
import hmac
import secrets
import time
from collections import deque
from typing import Any, Callable

from tabcohort.errors import RemoteProtocolError
from tabcohort.wire import WireLimits, parse_route

from .config import JobConfig, ServerLimits

#: WebSocket close codes (application range 4000-4999) with their reasons.
CLOSE_BAD_REGISTER = 4000
CLOSE_BAD_TOKEN = 4001
CLOSE_UNKNOWN_ID = 4004
CLOSE_SLOW_CONSUMER = 4008
CLOSE_ROOM_FULL = 4009
CLOSE_REPLACED = 4010

#: Report fields kept from a rank's state report (anything else is ignored).
REPORT_FIELDS = ("id", "leader", "is_leader", "ready", "running", "joining", "step", "cohort", "loss",
                 "accuracy", "steps_per_s", "samples_per_s", "wire_bytes_per_s", "bucket_len",
                 "batch", "model", "backend", "precision", "lr", "fault", "policy", "digest", "pid",
                 "leaders", "first_loss", "start_step", "final", "wire_drops", "links", "link_bytes",
                 "counters", "gaps", "kind")


class RoomError(Exception):
    """A registration the room refuses; ``code`` and ``reason`` become the close frame."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class Peer:
    """One rank's seat in a room: its id, resume secret, relay queue and last report."""

    def __init__(self, rank_id: int, secret: str) -> None:
        self.id = rank_id
        self.secret = secret
        self.connected = False
        self.disconnected_at: float | None = None
        self.queue: deque[bytes | str] = deque()
        self.queued_bytes = 0
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

    def pop(self) -> bytes | str:
        item = self.queue.popleft()
        self.queued_bytes -= len(item)
        return item


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
        self._pressure_sent = 0.0
        self._in_pressure = False
        #: max-heap of (-(queued + backlog), version, id), stale entries dropped lazily: the max
        #: load in O(log n) per relayed frame instead of a scan of every rank (200-rank profile)
        self._loads: list[tuple[int, int, int]] = []

    # ------------------------------------------------------------------ membership
    def register(self, *, now: float, resume_id: int | None = None, resume_secret: str | None = None) -> Peer:
        """Seat a rank: a fresh random uint32 id, or its old id when resuming within grace.

        Raises:
            RoomError: room full, or a resume with an unknown id or wrong secret.
        """
        if resume_id is not None:
            p = self.peers.get(resume_id)
            if p is None and self._adoptable(resume_id, resume_secret):
                if len(self.peers) >= self.limits.max_ranks_per_room:
                    raise RoomError(CLOSE_ROOM_FULL, f"room full ({self.limits.max_ranks_per_room} ranks)")
                p = self.peers[resume_id] = Peer(resume_id, self._secret(resume_id))
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
            while True:
                k = self.rng.getrandbits(32)
                if k not in self.peers and k != 0:
                    break
            p = self.peers[k] = Peer(k, self._secret(k))
        p.connected = True
        p.disconnected_at = None
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
        p.queued_bytes = 0
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

    def relay(self, sender: Peer, chunk: bytes) -> None:
        """Route one chunk from ``sender``'s link by its header; never decodes the payload."""
        sender.n_in += 1
        self.frames_in += 1
        self.bytes_in += len(chunk)
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
            self._enqueue(p, chunk)
        else:
            mesh = self.job.topology == "mesh"
            for p in list(self.connected.values()):
                if p is not sender and (not mesh or p.id in sender.relay_peers):
                    self._enqueue(p, chunk)
        self._update_pressure()

    def _enqueue(self, p: Peer, item: bytes | str) -> None:
        if not p.connected:
            return
        n = len(item)
        if (p.queued_bytes + n > self.limits.queue_max_bytes
                or len(p.queue) >= self.limits.queue_max_items):
            self.drop("slow_consumer")
            self._disconnect(p, self.clock(),
                             reason=(CLOSE_SLOW_CONSUMER, "slow consumer: relay queue over its bound"))
            return
        p.queue.append(item)
        p.queued_bytes += n
        self._load_changed(p)
        if isinstance(item, bytes):
            self.frames_relayed += 1
            self.bytes_relayed += n
        if p.wake is not None:
            p.wake()

    def sent(self, p: Peer, item: bytes | str) -> None:
        """The socket layer wrote ``item`` (popped from ``p.queue``) to the socket."""
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
        """Max over connected ranks of (queued relay bytes + reported receive backlog) / high-water mark."""
        loads = self._loads
        while loads:
            neg, version, k = loads[0]
            q = self.connected.get(k)
            if q is None or q.load_version != version:
                heapq.heappop(loads)           # stale: a newer entry or a gone rank
                continue
            load = q.queued_bytes + q.rx_backlog
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

    def send_control(self, p: Peer, obj: dict) -> None:
        self._enqueue(p, json.dumps(obj, separators=(",", ":")))

    # ------------------------------------------------------------------ control messages
    def control(self, p: Peer, text: str, *, now: float) -> None:
        """Handle a text message from a registered rank; bad input is counted, never raised."""
        p.n_in += 1
        if len(text) > self.limits.max_control_bytes:
            self.drop("control_too_big")
            return
        try:
            obj = json.loads(text)
        except ValueError:
            self.drop("bad_control")
            return
        t = obj.get("type") if isinstance(obj, dict) else None
        if t == "signal":
            self.signal(p, obj)
            return
        if t == "backlog":
            n = obj.get("bytes")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                self.drop("bad_control")
                return
            p.rx_backlog = min(n, self.limits.queue_max_bytes)
            self._load_changed(p)
            self._update_pressure()
            return
        if t == "relay_peers":
            ids = obj.get("ids")
            if not isinstance(ids, list) or not all(isinstance(k, int) and not isinstance(k, bool) for k in ids):
                self.drop("bad_control")
                return
            p.relay_peers = set(ids)
            return
        if t != "report" or not isinstance(obj.get("state"), dict):
            self.drop("bad_control")
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
            self.drop("bad_signal")
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
        self.send_control(q, fwd)

    # ------------------------------------------------------------------ state and stop
    def leader_report(self) -> dict | None:
        """The freshest report of a connected rank that says it leads (or the highest step)."""
        reps = [p.report for p in self.connected.values() if p.report]
        if not reps:
            return None
        leaders = [r for r in reps if r.get("is_leader")]
        return max(leaders or reps, key=lambda r: _num(r.get("step")))

    def step(self) -> int:
        return max((int(_num(p.report.get("step"))) for p in self.peers.values() if p.report), default=0)

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
        if why is not None:
            self.stop(why)
        return self.stopped

    def stop(self, reason: str) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.stop_reason = reason
        self.broadcast_control({"type": "stop", "reason": reason})

    def summary(self, now: float) -> dict[str, Any]:
        """The room as JSON-ready data (``GET /api/rooms/{room}``)."""
        lead = self.leader_report()
        ranks = []
        for p in sorted(self.peers.values(), key=lambda p: p.id):
            ranks.append({"id": p.id, "id_hex": f"{p.id:08x}", "connected": p.connected,
                          "link": "rtc" if p.rtc is not None and p.rtc.up else "ws",
                          "queued_bytes": p.queued_bytes,
                          "report_age_s": None if p.report_at is None else round(now - p.report_at, 3),
                          "report": p.report})
        return {"room": self.name, "topology": self.job.topology,
                "link": "rtc" if self.job.topology == "mesh" else "ws",
                "n_connected": len(self.connected), "n_reserved": len(self.peers) - len(self.connected),
                "step": self.step(), "leader": None if lead is None else lead.get("leader"),
                "loss": None if lead is None else _json_num(lead.get("loss")),
                "accuracy": None if lead is None else _json_num(lead.get("accuracy")),
                "stopped": self.stopped, "stop_reason": self.stop_reason,
                "resumed_from_step": self.resumed_from_step,
                "checkpoint": self.checkpoint, "pressure": round(self.pressure(), 3),
                "counters": {"frames_in": self.frames_in, "bytes_in": self.bytes_in,
                             "frames_relayed": self.frames_relayed, "bytes_relayed": self.bytes_relayed},
                "drops": dict(self.drops), "ranks": ranks}


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return -math.inf
    return float(v)


def _json_num(v: Any) -> float | None:
    x = _num(v)
    return None if x == -math.inf else x


class RoomRegistry:
    """All rooms of one server."""

    def __init__(self, jobs: dict[str, JobConfig], limits: ServerLimits, seed: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        rng = random.Random(seed) if seed is not None else random.SystemRandom()
        self.rooms = {name: Room(name, job, limits, rng, clock) for name, job in jobs.items()}

    def get(self, name: str) -> Room | None:
        return self.rooms.get(name)

    def tick(self, now: float) -> None:
        """Periodic work: release expired ids, check duration stop conditions."""
        for room in self.rooms.values():
            room.expire(now)
            room.check_stop(now)
