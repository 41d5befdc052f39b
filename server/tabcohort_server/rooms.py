"""Room bookkeeping as plain Python (no aiohttp): ids, the star relay's routing and queues,
state reports, stop conditions and counters. The aiohttp layer (app.py) owns the sockets and
calls in here; this module tells it whom to wake (``Peer.wake``) and whom to drop
(``Peer.kick``).

Relay rules (README "Server, native ranks and tabs" and "Limits"): each chunk is routed by its
routing header (:func:`tabcohort.wire.parse_route`) without decoding the payload; a chunk whose
``from`` disagrees with the link's bound id is dropped (``spoofed``). Each link may send at most
``sender_max_msgs_per_s`` messages and ``sender_max_bytes_per_s`` bytes per second (token
buckets); beyond that its messages are dropped (``rate_limited``) and a link that keeps on is
closed (4029), except a WebSocket link's bytes: its reader waits for the byte budget
(:meth:`Room.byte_wait_s`) instead, so TCP back-pressure slows the sender and no chunk of a
frame is lost. Each receiver's queue holds one FIFO per sender, served round-robin with the
server's controls first (:class:`~.fairness.FairQueue`); when a receiver's queue is full the
sender holding the most of it loses its newest items there (``fair_share``: the rest of that frame
is dropped for that receiver too), so one sender's flood never closes another rank. A receiver is
a slow consumer (closed 4008) only when one write to it has not completed for ``write_stall_s``
or its queue is full of the server's own controls: what it reads, not what others send.

Control messages (text) are validated by :mod:`.schema` before a field is read; invalid ones are
dropped and counted by reason. Roles (docs/PROTOCOL.md, "Roles"): the server binds to each link
whether its rank may lead (it registered with the trainer credential, or the room lets any rank
lead) and announces it in ``welcome`` and ``peer``. The room's step and stop conditions trust
only the report of the room's current leader (:meth:`Room.leader_peer`: a rank that may lead and
reports that it leads; the highest term wins), and of that only a plausible step; a ``backlog``
claim adds at most ``backlog_max_pressure`` to the room's pressure.
"""

from __future__ import annotations

import json
import math
import random
import hashlib
import logging
import heapq
import hmac
import struct
import time
from collections import Counter
from typing import Any, Callable

from tabcohort.errors import RemoteProtocolError
from tabcohort.wire.chunk import parse_route
from tabcohort.wire.limits import WireLimits

from .config import JobConfig, ServerLimits, same_secret
from .fairness import SERVER, FairQueue, TokenBucket
from .guard import client_key
from .schema import check_control, parse_json, too_deep

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
                 "pair_bytes",
                 "counters", "gaps", "drops", "transport", "rejoins",
                 "term", "members", "majority", "diverged", "global_batch", "samples_assigned", "epoch",
                 "shares", "speeds", "lateness_ms", "held_ms", "applied", "flaps", "probation", "round_gaps", "kind",
                 "backend_note", "adapter",
                 "may_lead", "aggregate", "clipped", "quarantined", "silent", "page_inbox",
                 "local_steps", "outer_optimizer")
#: Report fields shown only to the operator (``/api/rooms/ROOM`` with the operator token).
OPERATOR_FIELDS = ("pid",)
#: what a request without the operator token sees of a rank's report other than the trusted
#: rank's (``Room.summary``): small scalars. Every report whole made one address's 64 seats of
#: 64 KiB reports a 3.3 MB answer to each page's poll (a hostile trial); the page reads only the
#: trusted rank's report, the operator view all of them.
PUBLIC_REPORT_FIELDS = ("step", "is_leader", "ready", "running", "cohort", "loss", "backend", "kind", "model",
                        "samples_per_s", "steps_per_s")
#: Offset of ``frame_id`` in a chunk's routing header (``tabcohort.wire``: u8 version, u8 flags,
#: u32 sender, u32 recipient, u32 frame_id, ...).
_FRAME_ID = struct.Struct("<I")
_FRAME_ID_AT = 10


#: released rank ids a room remembers (never re-seated, never drawn for a new rank); 64 Ki ids,
#: about 8 MiB at most
RELEASED_IDS_KEPT = 65536


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
        #: the client's address as its per-address bounds see it (guard.client_key), or None
        self.address = None if address is None else client_key(address)
        self.connected = False
        self.disconnected_at: float | None = None
        self.queue = FairQueue()
        #: ingress token buckets (messages, bytes) and the strike bucket that closes a link
        #: that keeps sending over its rate (set at each connect)
        self.msg_bucket: TokenBucket | None = None
        self.byte_bucket: TokenBucket | None = None
        self.strikes: TokenBucket | None = None
        #: the link's report budget (Room._report_due; new at each connect)
        self.report_bucket: TokenBucket | None = None
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
        #: (text, when) of the fault last passed to the room's ``on_fault`` listeners, and the
        #: latest one reported since that is not said yet (held back by FAULT_SAY_INTERVAL_S)
        self.fault_said: tuple[str, float] | None = None
        self.fault_unsaid: str | None = None
        self.load_version = 0      # bumps at every change of queued_bytes + rx_backlog (Room._loads)
        self.n_in = 0              # messages received from this rank (chunks + controls)
        self.n_out = 0             # messages written to this rank's socket
        self.bytes_out = 0
        self.report: dict | None = None
        self.report_at: float | None = None
        #: the role the server bound to this link at register (docs/PROTOCOL.md, "Roles"):
        #: may it lead (trainer credential, or a room where any rank may lead)
        self.may_lead = False
        #: the peers this rank reaches through the relay (``relay_peers`` control): its broadcast
        #: chunks are relayed to those only (the others get them on a channel or a direct TCP
        #: path). ``None`` (never declared): every peer in a star room, none in a mesh room.
        self.relay_peers: set[int] | None = None
        #: star rooms: the rank's WebRTC link, when it has one (set by rtc_relay); ``None`` = ws.
        self.rtc: Any = None
        #: set by the socket layer: wake the writer / close the socket with (code, reason)
        self.wake: Callable[[], None] | None = None
        self.kick: Callable[[int, str], None] | None = None

    @property
    def queued_bytes(self) -> int:
        return self.queue.n_bytes

    #: the most bytes a ``backlog`` claim can bring this rank's load to (set by the room)
    backlog_cap_bytes = 1 << 62

    @property
    def load_bytes(self) -> int:
        """What this rank adds to the room's pressure: its relay queue, raised by its claimed
        receive backlog up to ``backlog_cap_bytes`` at most (a claim never lifts the load beyond
        the cap; the server's own queue counts whole)."""
        q = self.queue.n_bytes
        return max(q, min(q + self.rx_backlog, self.backlog_cap_bytes))

    def pop(self) -> bytes | str:
        return self.queue.pop()

    def charge(self, reason: str, n: int = 1) -> None:
        self.charged[reason] = self.charged.get(reason, 0) + n


#: A link's state reports: at most this many per the job's ``report_interval_s`` (a rank sends
#: one per interval), in bursts of ``REPORT_BURST`` (a final report right after a periodic one);
#: the rest are dropped before they are checked (``report_rate_limited``). Why: the room keeps
#: only a rank's latest report, and checking one of 64 KiB is the dearest control there is (with
#: jsonschema 54-261 ms each; 40 sockets sending one a second stalled the server's loop).
REPORTS_PER_INTERVAL = 2.0
REPORT_BURST = 4.0
#: A control text longer than this spends the report budget before it is parsed (json.loads of
#: 61 KB took 1-2 ms): only a report is that large (a ``signal``'s SDP is at most 16 KiB, a
#: ``relay_peers`` of 1,024 seats about 11 KB). A smaller report spends it once parsed.
LARGE_CONTROL_BYTES = 32768

#: a rank's reported fault (its job failed, its updates diverged...) is passed to the room's
#: ``on_fault`` listeners (``tabcohort serve`` prints a line) when it changes, at most once per
#: this many seconds per rank (the latest one held back is said once the interval passed, or as
#: the rank leaves): the operator view shows every report, the console a summary
FAULT_SAY_INTERVAL_S = 10.0

#: and at most this many fault lines a minute per room, in bursts of FAULT_LINES_BURST (a room
#: of hundreds of seats, any of which may report a fault, must not flood the console): the
#: ones over it are counted (``Room.faults_unsaid``) and the next line says how many
FAULT_LINES_PER_MINUTE = 20.0
FAULT_LINES_BURST = 10.0

#: a room's join and leave lines (``Room.on_membership``): at most this many a minute, in bursts
#: of MEMBERSHIP_LINES_BURST (hundreds of tabs opening one page must not flood the console;
#: the rest are counted in ``Room.membership_unsaid`` and the next line says how many)
MEMBERSHIP_LINES_PER_MINUTE = 20.0
MEMBERSHIP_LINES_BURST = 10.0

#: the ranks' reconnect bound, seconds (``tabcohort.bus.room.RECONNECT_MAX_S``; the server does
#: not import the bus): the ranks of a restarted server come back within it, whatever the
#: server's own ``resume_grace_s``, so its roll call is partial at least this long
RANK_RECONNECT_MAX_S = 30.0


class Room:
    """One room: a job and the ranks training it over the star relay.

    Args:
        name: the room name.
        job: the job configuration.
        limits: server limits (queue bounds, room size, grace).
        rng: source of rank ids and resume secrets.
    """

    def __init__(self, name: str, job: JobConfig, limits: ServerLimits,
                 rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic,
                 any_rank_may_lead: bool = False) -> None:
        self.name = name
        #: trusted-group room: every rank may lead, credential or not (README "Trust model")
        self.any_rank_may_lead = bool(any_rank_may_lead)
        #: the room's checkpoint history (``checkpoint.CheckpointStore``; set by the app)
        self.store: Any = None
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
        #: WebSocket messages whose relay waited for the sender's byte budget, and the seconds waited
        self.byte_paced = 0
        self.byte_paced_s = 0.0
        self.drops: dict[str, int] = {}
        self.started_at: float | None = None
        self.stopped = False
        self.stop_reason: str | None = None
        #: the learning rate the operator set (``POST .../lr``), told to every rank that joins
        #: later in its ``welcome`` (the served job keeps the lr it started with)
        self.operator_lr: float | None = None
        #: called with the room once it stops (``tabcohort serve`` prints a line)
        self.on_stop: list[Callable[[Room], None]] = []
        #: in a cluster: the URLs of the other nodes that can host the room (``welcome``'s
        #: ``nodes``, where a rank goes when its node and its --server do not answer)
        self.other_nodes: Callable[[], list[str]] | None = None
        #: called with the room and the checkpoint's metadata when a final checkpoint is stored
        #: (``tabcohort serve`` prints it: the stop line said one would follow)
        self.on_final_checkpoint: list[Callable[[Room, dict], None]] = []
        self.final_checkpoint_said = False
        #: called with the room, the rank's id and its reported fault (untrusted text, any
        #: characters, at most the report schema's string length) when a rank's fault changes,
        #: at most once per FAULT_SAY_INTERVAL_S per rank (``tabcohort serve`` prints a line)
        self.on_fault: list[Callable[[Room, int, str], None]] = []
        self._fault_lines: TokenBucket | None = None
        #: faults not said over the room's line budget since the last one said (a listener
        #: reads it with the next one and sets it back to 0)
        self.faults_unsaid = 0
        #: called with the room, the rank and ``"joined"``, ``"resumed"``, ``"left"`` or
        #: ``"sent_away"`` when a rank takes a seat, takes its seat again, its link closes (not
        #: when a newer link of its own replaced it) or this node sent it to the room's owner
        #: (:meth:`evict_all`), within MEMBERSHIP_LINES_PER_MINUTE (``tabcohort serve`` prints
        #: a line: a newcomer's console said nothing while ranks came and went)
        self.on_membership: list[Callable[[Room, Peer, str], None]] = []
        self._membership_lines: TokenBucket | None = None
        #: joins and leaves not said over that budget since the last one said (a listener reads
        #: it with the next one and sets it back to 0)
        self.membership_unsaid = 0
        self.checkpoint: dict | None = None     # meta of the latest checkpoint
        self.resumed_from_step: int | None = None   # the checkpoint's step when the server started on it
        self.resumed_from: dict | None = None       # that checkpoint's {id, step, accuracy}
        #: resume secrets are HMAC(secret_key, room:id) when set (the app sets it; it persists in
        #: the checkpoint directory), so a restarted server re-seats a rank that resumes with its
        #: id and secret although it never issued that id; ids released here are not re-seated
        #: while the room remembers them (the newest RELEASED_IDS_KEPT; a restart forgets them all).
        self.secret_key: bytes | None = None
        #: released ids, oldest first, at most RELEASED_IDS_KEPT (an ordered set: every expired
        #: rank added one for good, 0.5 GB a day at the registration limit); a new rank never
        #: gets one of them, and one forgotten is as unlikely to be drawn as any other id
        self._released: dict[int, None] = {}
        #: until when ranks of the room's previous life (before a restart on the same checkpoint
        #: directory, or on the cluster node that owned it) may still come back under their ids:
        #: its roll call is partial till then (PROTOCOL.md, "Membership and majority")
        self._partial_until = -math.inf
        self._partial_welcomes = 0
        self._roll_call_told = True
        self._diverging: tuple[float, float, float] | None = None   # (since, step, diverged count)
        #: the training loss above which the parameters ran away (10 x ln classes for a softmax
        #: cross-entropy job, ``jobs.worker.loss_ceiling``; the app sets it), or None
        self.loss_ceiling: float | None = None
        self._loss_high_since: float | None = None
        self._pressure_sent = 0.0
        self._pressure_sent_at = -math.inf
        self._pressure_dirty = False      # a change not yet told (within pressure_report_s)
        self.n_pressure_coalesced = 0     # changes held back by pressure_report_s
        self._in_pressure = False
        #: max-heap of (-(queued + backlog), version, id), stale entries dropped lazily: the max
        #: load in O(log n) per relayed frame instead of a scan of every rank (200-rank profile)
        self._loads: list[tuple[int, int, int]] = []
        #: the trusted leader's last step (``step()``); never the highest claim. ``_trusted_at``:
        #: when it was trusted (None: no baseline yet; the first leader report sets it)
        self._trusted_step = 0
        #: the last trusted leader report: the room's loss, accuracy and term while none leads
        #: (a finished room keeps its last figures)
        self._last_lead: dict | None = None
        self._trusted_at: float | None = None
        #: the id of the last rank that was the room's current leader (``leader_peer``)
        self.last_leader_id: int | None = None

    # ------------------------------------------------------------------ membership
    def seats_of(self, address: str | None) -> int:
        """Seats (connected and reserved) held from ``address`` (its guard.client_key: an IPv6
        /64 is one address)."""
        if address is None:
            return 0
        key = client_key(address)
        return sum(1 for q in self.peers.values() if q.address == key)

    def _check_address(self, address: str | None, now: float) -> None:
        cap = self.limits.max_ranks_per_address
        if address is not None and self.seats_of(address) >= cap:
            self.expire(now)
            if self.seats_of(address) >= cap:
                raise RoomError(CLOSE_ADDRESS_FULL, f"too many ranks from one address ({cap}; "
                                                    f"the operator can raise --max-ranks-per-address)")

    def register(self, *, now: float, resume_id: int | None = None, resume_secret: str | None = None,
                 address: str | None = None, trainer: bool = False) -> Peer:
        """Seat a rank: a fresh random uint32 id, or its old id when resuming within grace.

        Args:
            address: the client's network address; at most ``limits.max_ranks_per_address``
                seats (connected or reserved) per address (``None``: not bounded).
            trainer: the rank presented the trainer credential; it may lead (so may every rank
                of a room with ``any_rank_may_lead``). Bound at every register, resumes included.

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
            if p is None or not same_secret(p.secret, resume_secret):
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
                if k not in self.peers and k != 0 and k not in self._released:
                    break
            p = self.peers[k] = Peer(k, self._secret(k), address)
        p.connected = True
        p.disconnected_at = None
        p.backlog_cap_bytes = int(self.limits.backlog_max_pressure * self.limits.queue_high_water_bytes)
        p.may_lead = bool(trainer) or self.any_rank_may_lead
        lim = self.limits
        p.msg_bucket = TokenBucket(lim.sender_max_msgs_per_s, 2 * lim.sender_max_msgs_per_s, now)
        # a rank that may lead sends the rounds (every parameter, to everyone); a contributor only
        # its buckets (README "Limits": a contributor's budget is the smaller one)
        byte_rate = lim.sender_max_bytes_per_s if p.may_lead else lim.contributor_max_bytes_per_s
        p.byte_bucket = TokenBucket(byte_rate, byte_rate, now)
        # excess messages a link may send before it is closed: rate_limit_close_s seconds' worth
        # of its rate, refilled at a quarter of its rate (a sender persistently over 1.25x its
        # rate is closed; one that bursts over now and then only loses the excess)
        p.strikes = TokenBucket(lim.sender_max_msgs_per_s / 4,
                                lim.sender_max_msgs_per_s * lim.rate_limit_close_s, now)
        p.report_bucket = None      # (full again: a rank reports at once when it connects)
        p.skip.clear()
        p.write_since = None
        self.connected[p.id] = p
        if self.started_at is None:
            self.started_at = now
        self._say_membership(p, "resumed" if resume_id is not None else "joined", now)
        return p

    def _say_membership(self, p: Peer, event: str, now: float) -> None:
        """Pass a join, resume or leave to the ``on_membership`` listeners, within the room's
        line budget (the rest counted in :attr:`membership_unsaid`)."""
        if not self.on_membership:
            return
        if self._membership_lines is None:
            self._membership_lines = TokenBucket(MEMBERSHIP_LINES_PER_MINUTE / 60.0, MEMBERSHIP_LINES_BURST, now)
        if not self._membership_lines.take(1, now):
            self.membership_unsaid += 1
            return
        for f in list(self.on_membership):
            try:
                f(self, p, event)
            except Exception:   # (a registration must not fail after its seat was taken)
                logging.getLogger("tabcohort.server").exception("room %s: a membership listener failed", self.name)

    def _secret(self, k: int) -> str:
        if self.secret_key is None:
            return "%032x" % self.rng.getrandbits(128)
        return hmac.new(self.secret_key, f"{self.name}:{k}".encode(), hashlib.sha256).hexdigest()[:32]

    def _adoptable(self, k: int, secret: object) -> bool:
        """A resume for an id this process never seated (the server restarted) with a valid secret."""
        return (self.secret_key is not None and 0 < k < 1 << 32
                and k not in self._released and same_secret(self._secret(k), secret))

    def welcome(self, p: Peer, *, resumed: bool) -> dict:
        """The ``welcome`` control: the rank's id, secret and role (``may_lead``), the peers
        already connected and which of them may lead (``lead_peers``), and the checkpoint a
        fresh cohort resumes from (``checkpoint``: id, step, accuracy; None if none), and the
        learning rate the operator set, once set (``lr``)."""
        newest = None if self.store is None else self.store.latest_meta()
        partial = self.roll_call_partial(self.clock())
        self._partial_welcomes += partial
        return {"type": "welcome", "id": p.id, "secret": p.secret, "room": self.name,
                "topology": self.job.topology,
                "resumed": resumed, "stopped": self.stopped,
                "peers": sorted(k for k in self.connected if k != p.id),
                "may_lead": p.may_lead,
                "lead_peers": sorted(k for k, q in self.connected.items() if k != p.id and q.may_lead),
                "checkpoint": None if newest is None else {
                    "id": newest["id"], "step": newest["step"], "accuracy": newest.get("accuracy")},
                "high_water_bytes": self.limits.queue_high_water_bytes,
                "max_message_bytes": self.limits.max_ws_message_bytes,
                **({"nodes": self.other_nodes()[:16]} if self.other_nodes is not None else {}),
                **({"lr": self.operator_lr} if self.operator_lr is not None else {}),
                **({"partial": True} if partial else {})}

    def expect_returning_ranks(self, now: float) -> None:
        """This process took the room up from a previous life (a start on a checkpoint directory,
        whose resume key re-seats the ids it issued; a cluster node acquiring the room): its
        ranks reconnect one by one, each within its reconnect bound (``RANK_RECONNECT_MAX_S``)
        and, past its id's reservation (``resume_grace_s``), as a new rank; until the longer of
        the two has passed (the first: ``limits.roll_call_s``, ``RANK_RECONNECT_MAX_S`` unless
        told) the roll call of a ``welcome`` is partial (:meth:`roll_call_partial`).
        Why not ``resume_grace_s`` alone: with ``serve --grace 1`` a rank back 2 s after the
        restart was told the others had left, and two lineages trained."""
        self._partial_until = now + max(self.limits.resume_grace_s, self.limits.roll_call_s)
        self._partial_welcomes, self._roll_call_told = 0, False

    def roll_call_partial(self, now: float) -> bool:
        """Whether the ranks connected now may not be all the room has (PROTOCOL.md, "Membership
        and majority", the roll call): other ranks may still be on their way back."""
        return now < self._partial_until

    def flush_roll_call(self, now: float) -> None:
        """Once the partial window is over, tell every connected rank the whole roll call (a
        ``roll_call`` control), if a partial ``welcome`` went out: a member it does not list
        has not come back, and only now is that the evidence the witness gives."""
        if self._roll_call_told or not self._partial_welcomes or self.roll_call_partial(now):
            return
        self._roll_call_told = True
        self.broadcast_control({"type": "roll_call", "peers": sorted(self.connected)})

    def announce(self, p: Peer, up: bool) -> None:
        """Tell the other connected ranks that ``p`` joined or left the relay, and its role."""
        self.broadcast_control({"type": "peer", "id": p.id, "up": up, "may_lead": p.may_lead}, exclude=p.id)

    def disconnect(self, p: Peer, now: float) -> None:
        """The socket of ``p`` ended; its id stays reserved for ``resume_grace_s``."""
        if p.connected and self.connected.get(p.id) is p:
            self._disconnect(p, now)

    def _say_fault(self, p: Peer, now: float) -> None:
        """Pass ``p``'s latest fault not yet said to the ``on_fault`` listeners."""
        fault, p.fault_unsaid = p.fault_unsaid, None
        if fault is None:
            return
        p.fault_said = (fault, now)
        if self._fault_lines is None:
            self._fault_lines = TokenBucket(FAULT_LINES_PER_MINUTE / 60.0, FAULT_LINES_BURST, now)
        if not self._fault_lines.take(1, now):
            self.faults_unsaid += 1
            return
        for f in list(self.on_fault):   # (each catches its own errors, as on_stop's)
            f(self, p.id, fault)

    def _disconnect(self, p: Peer, now: float, reason: tuple[int, str] | None = None,
                    event: str = "left") -> None:
        # a fault held back by the interval is said as the rank leaves: often the one it left for
        # (a job that failed right after another fault was said)
        self._say_fault(p, now)
        p.connected = False
        p.disconnected_at = now
        self.connected.pop(p.id, None)
        p.relay_peers = None
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
        if reason is None or reason[0] != CLOSE_REPLACED:   # (replaced: its new link says "resumed")
            self._say_membership(p, event, now)

    def evict_all(self, code: int, reason: str, now: float) -> int:
        """Close every connected rank's link with ``(code, reason)`` (their ids stay reserved);
        a cluster node that lost the room sends its ranks to the owner this way (each said as
        ``"sent_away"`` to the ``on_membership`` listeners: its seat here is of no use to it).
        Returns how many."""
        ps = list(self.connected.values())
        for p in ps:
            self._disconnect(p, now, reason=(code, reason), event="sent_away")
        # (the owner node reports the room from now on: this node's /metrics kept showing the
        # last loss, accuracy and term it had trusted, Room.headline)
        self._last_lead = None
        return len(ps)

    def expire(self, now: float) -> list[int]:
        """Release the ids of ranks disconnected longer than the grace period."""
        gone = [k for k, p in self.peers.items()
                if not p.connected and p.disconnected_at is not None
                and now - p.disconnected_at > self.limits.resume_grace_s]
        for k in gone:
            del self.peers[k]
            self._released[k] = None
        while len(self._released) > RELEASED_IDS_KEPT:
            del self._released[next(iter(self._released))]
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

    def byte_wait_s(self, sender: Peer, n_bytes: int, now: float | None = None) -> float:
        """Seconds the reader of ``sender``'s WebSocket waits before relaying ``n_bytes`` (0.0:
        none), within ``sender_max_bytes_per_s``. Why a wait and not a drop: a chunk dropped
        for the byte rate loses the whole frame it belongs to; a leader sending 1M float32
        parameters 50 times a second (200 MB/s) lost the tail of a round every few seconds, and
        its follower, which never saw the round, was marked silent after a whole collect
        window. Not reading the socket makes TCP slow the sender down: its socket buffer fills,
        its bus reports pressure and its leader paces (PROTOCOL.md, "The leader loop")."""
        b = sender.byte_bucket
        if b is None or not sender.connected:
            return 0.0
        wait = b.wait_s(n_bytes, self.clock() if now is None else now)   # (admit's clock)
        if wait > 0.0:
            self.byte_paced += 1
            self.byte_paced_s += wait
        return wait

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
            only = sender.relay_peers
            if only is None and self.job.topology == "mesh":
                only = set()
            for p in list(self.connected.values()):
                if p is not sender and (only is None or p.id in only):
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
        heapq.heappush(self._loads, (-p.load_bytes, p.load_version, p.id))
        if len(self._loads) > 4 * len(self.connected) + 64:   # bound the stale entries
            self._loads = [(-q.load_bytes, q.load_version, q.id) for q in self.connected.values()]
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
            load = q.load_bytes
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
        """Tell every rank the relay pressure: at once when it crossed 1 or left 1 (leaders pace
        above 1, PROTOCOL.md "Bus contract"); otherwise when it moved by >= 0.1 or went to 0, at most
        once per ``pressure_report_s`` (a later call, or :meth:`tick`, sends the newest)."""
        if self._in_pressure:
            return
        p = round(self.pressure(), 2)
        last = self._pressure_sent
        self._pressure_dirty = False
        if (p > 1) == (last > 1) and (p >= 1) == (last >= 1):
            if abs(p - last) < 0.1 and (p == 0) == (last == 0):
                return
            now = self.clock()
            if now - self._pressure_sent_at < self.limits.pressure_report_s:
                self._pressure_dirty = True
                self.n_pressure_coalesced += 1
                return
            self._pressure_sent_at = now
        else:
            self._pressure_sent_at = self.clock()
        self._pressure_sent = p
        self._in_pressure = True
        try:
            self.broadcast_control({"type": "pressure", "p": p})
        finally:
            self._in_pressure = False

    def flush_pressure(self) -> None:
        """Tell a pressure change held back by ``pressure_report_s`` (called periodically)."""
        if self._pressure_dirty:
            self._update_pressure()

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
        # a large control spends the report budget before it is parsed (only a report is that
        # large); a smaller report once parsed, before the schema check
        # (junk nested too deep is still called so: the scan costs a fraction of a parse)
        large = len(text) > LARGE_CONTROL_BYTES
        if large and not self._report_due(p, now):
            why = "too_deep" if too_deep(text) else "report_rate_limited"
            self.drop(why)
            p.charge(why)
            return
        obj, why = parse_json(text)
        if (not large and why is None and isinstance(obj, dict) and obj.get("type") == "report"
                and not self._report_due(p, now)):
            self.drop("report_rate_limited")
            p.charge("report_rate_limited")
            return
        if why is None:
            why = check_control(obj, max_ranks=self.limits.max_ranks_per_room)
        if why is not None:
            self.drop(why)
            p.charge(why)
            return
        t = obj["type"]
        if t == "signal":
            self.signal(p, obj)
            return
        if t == "backlog":
            cap = int(self.limits.backlog_max_pressure * self.limits.queue_high_water_bytes)
            n = obj["bytes"]
            if n > cap:   # a claim cannot pace the room (ServerLimits.backlog_max_pressure)
                self.drop("backlog_clamped")
                p.charge("backlog_clamped")
                n = cap
            p.rx_backlog = n
            self._load_changed(p)
            self._update_pressure()
            return
        if t == "relay_peers":
            p.relay_peers = set(obj["ids"])
            return
        st = obj["state"]
        rep = {k: st[k] for k in REPORT_FIELDS if k in st}
        rep["id"] = p.id
        if rep.get("is_leader") is True and not p.may_lead:
            self.drop("lead_claim_refused")      # reported, shown, never trusted
            p.charge("lead_claim_refused")
        old, old_at = p.report, p.report_at
        p.report = rep
        p.report_at = now
        if self.trusted_peer() is p and not self._trust_step(rep, now):
            p.report, p.report_at = old, old_at  # an implausible step: the whole report is dropped
            self.drop("report_step_jump")
            p.charge("report_step_jump")
            return
        lead = self.leader_peer()
        if lead is not None:
            self.last_leader_id = lead.id
        fault = rep.get("fault")
        if fault and (p.fault_said is None or fault != p.fault_said[0]):
            p.fault_unsaid = fault
        if p.fault_unsaid is not None and (p.fault_said is None or now - p.fault_said[1] >= FAULT_SAY_INTERVAL_S):
            self._say_fault(p, now)
        self.check_stop(now)

    def _report_due(self, p: Peer, now: float) -> bool:
        """Spend one of ``p``'s report tokens: ``REPORTS_PER_INTERVAL`` per the job's
        ``report_interval_s``, bursts of ``REPORT_BURST``. False: the report is dropped
        (``report_rate_limited``) before it is checked, whatever the link's message budget."""
        rate = REPORTS_PER_INTERVAL / self.job.report_interval_s
        b = p.report_bucket
        if b is None:
            b = p.report_bucket = TokenBucket(rate, REPORT_BURST, now)
        b.rate = rate               # (the room's job can change: the rate follows it)
        return b.take(1, now)

    def may_upload(self, p: Peer) -> bool:
        """Whether ``p`` may store a checkpoint: it may lead and is the rank the room trusts
        (:meth:`trusted_peer`: the current leader; or the last one, a leader that stopped at
        ``--steps`` and reports so; or the one the ranks name), or no rank is trusted yet (a
        leader so quick it stopped before its first report)."""
        if not p.connected or not p.may_lead:
            return False
        t = self.trusted_peer()
        return t is p or t is None    # (None: a leader so quick it stopped before it reported)

    def trust_step(self, step: int, now: float) -> None:
        """Set the room's trusted step baseline (a checkpoint the room resumes from)."""
        self._trusted_step, self._trusted_at = int(step), now

    def _trust_step(self, rep: dict, now: float) -> bool:
        """Take the current leader's reported step as the room's step when it is plausible:
        at most ``step_jump_slack + max_steps_per_s x`` the seconds since the last trusted step
        ahead of it (a lower step is taken: it cannot meet a stop condition). False: refused."""
        s = rep.get("step")
        if isinstance(s, bool) or not isinstance(s, int):
            return True                          # no step claimed: nothing to trust
        if not self.plausible_step(s, now):
            return False
        self._trusted_step, self._trusted_at = s, now
        self._last_lead = rep                    # its loss and accuracy outlive its lead
        return True

    def plausible_step(self, step: int, now: float) -> bool:
        """Whether ``step`` can follow the room's trusted step by now: at most
        ``step_jump_slack + max_steps_per_s x`` the seconds since it was trusted ahead (always,
        before the room has a baseline)."""
        if self._trusted_at is None:
            return True
        lim = self.limits
        return step <= self._trusted_step + lim.step_jump_slack + lim.max_steps_per_s * max(0.0, now - self._trusted_at)

    #: ``signal`` kinds the server forwards (WebRTC negotiation between two ranks).
    #: ``backlog``: a tab tells a mesh peer how many of its bytes it holds unconsumed;
    #: ``direct``: a native rank's TCP address and the pair's key (docs/PROTOCOL.md, "Direct TCP
    #: path"; forwarded as strings of bounded length, never interpreted here)
    SIGNAL_KINDS = ("offer", "answer", "candidate", "bye", "backlog", "direct")
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
        fwd = {k: obj[k] for k in ("kind", "sdp", "candidate", "bytes", "addr", "key") if k in obj}
        fwd.update(type="signal", to=to, **{"from": p.id})
        if kind == "backlog":
            # as the backlog control: a claim adds at most backlog_max_pressure high-water marks
            cap = p.backlog_cap_bytes
            n = fwd.get("bytes")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                self.drop("bad_signal")
                p.charge("bad_signal")
                return
            if n > cap:
                self.drop("backlog_clamped")
                p.charge("backlog_clamped")
                fwd["bytes"] = cap
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
    def leader_peer(self) -> Peer | None:
        """The room's current leader: among the connected ranks that may lead (the role the
        server bound to their links) and whose last report says they lead, the one whose lineage
        wins (docs/PROTOCOL.md, "Lineage and terms": the highest term; in one term the lower id).
        ``None`` when there is none.

        A rank cannot make the room stop (``--steps``, ``--target-accuracy``), show another step
        or upload a checkpoint by claiming to lead: without the role its claim is not counted.
        """
        best, key = None, None
        for p in self.connected.values():
            rep = p.report
            if not p.may_lead or not rep or rep.get("is_leader") is not True:
                continue
            term = rep.get("term")
            k = (term if isinstance(term, int) and not isinstance(term, bool) else 0, -p.id)
            if key is None or k > key:
                best, key = p, k
        return best

    def trusted_peer(self) -> Peer | None:
        """The rank whose reports the room trusts: the current leader (:meth:`leader_peer`), or
        while no rank leads, the last one that did if it is still connected (a leader that stopped
        at ``--steps`` reports its final step and uploads its final checkpoint as a non-leader)."""
        p = self.leader_peer()
        if p is not None:
            return p
        q = self.connected.get(self.last_leader_id) if self.last_leader_id is not None else None
        if q is not None and q.may_lead:
            return q
        # no rank has said it leads yet: the one that may lead most connected ranks name as
        # their leader (on a tie the lower step), never one without the role
        votes = Counter(r.report["leader"] for r in self.connected.values()
                        if r.report and isinstance(r.report.get("leader"), int))
        named = [self.connected[k] for k in votes if k in self.connected and self.connected[k].may_lead
                 and self.connected[k].report]
        if not named:
            return None
        top = max(votes[c.id] for c in named)
        return min((c for c in named if votes[c.id] == top), key=lambda c: _num(c.report.get("step")))

    def leader_report(self) -> dict | None:
        """The report the room trusts (:meth:`trusted_peer`'s), or None."""
        p = self.trusted_peer()
        return None if p is None else p.report

    def last_trusted_report(self) -> dict | None:
        """The trusted report (:meth:`leader_report`), or after its leader left the last report
        the room trusted (a stopped room's final one), or None before any."""
        lead = self.leader_report()
        return lead if lead is not None else self._last_lead

    def headline(self, lead: dict | None = None) -> dict[str, Any]:
        """The room's ``loss``, ``accuracy`` and ``term`` (JSON-ready numbers or None) as
        ``GET /api/rooms/ROOM`` and ``/metrics`` both show them: the trusted report's (``lead``,
        else :meth:`leader_report`), or while no leader reports the last trusted one's (a stopped
        room's final values: /metrics showed NaN once its ranks had left; a room between
        leaders), none after this node sent its ranks to the room's owner, and before any report
        the served checkpoint's accuracy; ``diverged`` only of a current leader."""
        lead = self.leader_report() if lead is None else lead
        last = lead if lead is not None else self._last_lead
        return {"loss": None if last is None else _json_num(last.get("loss")),
                # (a room served again after it finished has no report: its checkpoint's, not None)
                "accuracy": _json_num((self.checkpoint or {}).get("accuracy")) if last is None
                else _json_num(last.get("accuracy")),
                "term": None if last is None else _json_int(last.get("term")),
                "diverged": None if lead is None else _json_int(lead.get("diverged"))}

    def step(self) -> int:
        """The room's trusted step: the current leader's last plausible step (never the highest
        any rank claimed); while there is no leader, the last such step."""
        return self._trusted_step

    def stored_final(self, meta: dict) -> None:
        """A final checkpoint was stored: tell :attr:`on_final_checkpoint`."""
        for f in list(self.on_final_checkpoint):
            f(self, meta)

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
            why = self._diverged(lead, now) or self._ran_away(lead, now)
        if why is not None:
            self.stop(why)
        return self.stopped

    def _diverged(self, lead: dict, now: float) -> str | None:
        """``diverged ...`` once the leader, over ``DIVERGED_AFTER_S``, refused more updates that
        overflowed (its ``diverged`` count) than it applied (its step); else None. (Not "without
        its step advancing": a leader that overflows in nearly every round still applies one now
        and then, and on a slow machine that reset the window every few seconds for good.)"""
        step, n = _num(lead.get("step")), _num(lead.get("diverged"))
        since = self._diverging
        if n <= 0 or since is None or since[2] > n or since[1] > step:   # (none, or another leader's counts)
            self._diverging = (now, step, n)
            return None
        if now - since[0] < DIVERGED_AFTER_S:
            return None
        if n - since[2] > step - since[1]:
            return f"diverged at step {int(step)}: {str(lead.get('fault'))[:200].removeprefix('diverged: ')}"
        self._diverging = (now, step, n)     # training goes on: a new window
        return None

    def _ran_away(self, lead: dict, now: float) -> str | None:
        """``diverged ...`` once the leader's training loss has stayed above
        :attr:`loss_ceiling` for ``DIVERGED_AFTER_S``; else None."""
        loss = _num(lead.get("loss"))
        if self.loss_ceiling is None or not math.isfinite(loss) or loss <= self.loss_ceiling:
            self._loss_high_since = None
            return None
        if self._loss_high_since is None:
            self._loss_high_since = now
            return None
        if now - self._loss_high_since < DIVERGED_AFTER_S:
            return None
        return (f"diverged at step {int(_num(lead.get('step')))}: the training loss has stayed above "
                f"{self.loss_ceiling:.3g} (10x a uniform guess's) for {DIVERGED_AFTER_S:g} s, at "
                f"{loss:.4g}: the gradients stayed finite but the parameters ran away; try a smaller --lr "
                f"(now {self.job.lr:g})")

    def stop(self, reason: str) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.stop_reason = reason
        self.broadcast_control({"type": "stop", "reason": reason})
        for f in list(self.on_stop):
            f(self)

    def rank_drops(self) -> dict[str, dict[str, int]]:
        """Drops the connected ranks that may lead report (validated reports), summed by reason:
        ``{"protocol": {...}, "wire": {...}}`` (e.g. ``pretender``, ``stale_round``,
        ``grad_non_finite``; ``reassembly_timeout``). Every rank's own are in its row's report.
        Why only those: a rank of no role could invent reasons or claim 2^63 of one, and each
        reason is a metric label (up to 128 per connected rank)."""
        out: dict[str, dict[str, int]] = {"protocol": {}, "wire": {}}
        for p in self.connected.values():
            if not p.report or not p.may_lead:
                continue
            for kind, key in (("protocol", "drops"), ("wire", "wire_drops")):
                for reason, n in (p.report.get(key) or {}).items():
                    out[kind][reason] = out[kind].get(reason, 0) + n
        return out

    def robustness(self) -> dict[str, int]:
        """What the leaders' robust aggregation did, from the connected ranks' validated reports
        (docs/PROTOCOL.md "Untrusted ranks"): the most ranks any one report has ``quarantined``
        and ``silent``, and the most buckets any one report says it ``clipped`` (each leader keeps
        its own, so a maximum, not a sum: a leader change does not double count)."""
        out = {"quarantined": 0, "silent": 0, "clipped": 0}
        for p in self.connected.values():
            rep = p.report or {}
            out["quarantined"] = max(out["quarantined"], len(rep.get("quarantined") or {}))
            out["silent"] = max(out["silent"], len(rep.get("silent") or ()))
            out["clipped"] = max(out["clipped"], sum((rep.get("clipped") or {}).values()))
        return out

    #: path names the metrics keep as labels (anything else a report says counts as ``other``)
    PATH_LABELS = ("tcp", "rtc", "relay", "connecting", "ws")

    def rank_paths(self) -> tuple[dict[str, int], dict[str, int]]:
        """From the connected ranks' validated reports: pairs by path (``links``, peers only) and
        chunk bytes by path kind (``link_bytes``), each summed over the ranks (both ends)."""
        paths: dict[str, int] = {}
        nbytes: dict[str, int] = {}
        for p in self.connected.values():
            rep = p.report or {}
            for peer, kind in (rep.get("links") or {}).items():
                if peer != "server":
                    k = kind if kind in self.PATH_LABELS else "other"
                    paths[k] = paths.get(k, 0) + 1
            for kind, n in (rep.get("link_bytes") or {}).items():
                k = kind if kind in self.PATH_LABELS else "other"
                nbytes[k] = nbytes.get(k, 0) + n
        return paths, nbytes

    def summary(self, now: float, *, operator: bool = False) -> dict[str, Any]:
        """The room as JSON-ready data (``GET /api/rooms/{room}``); ``operator`` adds the
        fields only the operator sees (``OPERATOR_FIELDS``: the ranks' pids; the kept
        checkpoints, as ``GET .../checkpoints`` lists them for the operator only; and every
        rank's whole report, where others see the trusted rank's and ``PUBLIC_REPORT_FIELDS``
        of the rest)."""
        trusted = self.trusted_peer()
        lead = None if trusted is None else trusted.report
        ranks = []
        for p in sorted(self.peers.values(), key=lambda p: p.id):
            rep = p.report
            if rep is not None and not operator:
                if p is trusted:
                    rep = {k: v for k, v in rep.items() if k not in OPERATOR_FIELDS}
                else:
                    rep = {k: rep[k] for k in PUBLIC_REPORT_FIELDS if k in rep}
            ranks.append({"id": p.id, "id_hex": f"{p.id:08x}", "connected": p.connected,
                          "may_lead": p.may_lead, "role": "may lead" if p.may_lead else "contributes",
                          "link": "rtc" if p.rtc is not None and p.rtc.up else "ws",
                          "queued_bytes": p.queued_bytes, "charged": dict(p.charged),
                          "report_age_s": None if p.report_at is None else round(now - p.report_at, 3),
                          "report": rep})
        return {"room": self.name, "topology": self.job.topology,
                "link": "rtc" if self.job.topology == "mesh" else "ws",
                "n_connected": len(self.connected), "n_reserved": len(self.peers) - len(self.connected),
                "step": self.step(), "leader": None if lead is None else lead.get("leader"),
                # the rank whose report the room trusts (a rank with the role: a page shows the
                # shares, speeds and curves of this one, never of any rank that says it leads)
                "trusted_id": None if trusted is None else trusted.id,
                **self.headline(lead),
                "stopped": self.stopped, "stop_reason": self.stop_reason,
                "resumed_from_step": self.resumed_from_step,
                "resumed_from": self.resumed_from,
                "lead_policy": "any rank may lead" if self.any_rank_may_lead else "trainer credential",
                "checkpoint": self.checkpoint, "pressure": round(self.pressure(), 3),
                **({"checkpoints": [] if self.store is None else self.store.list()} if operator else {}),
                "counters": {"frames_in": self.frames_in, "bytes_in": self.bytes_in,
                             "frames_relayed": self.frames_relayed, "bytes_relayed": self.bytes_relayed,
                             "byte_paced": self.byte_paced, "byte_paced_s": round(self.byte_paced_s, 3)},
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


#: one address's admission rate is the server's divided by this (``RoomRegistry.admit``)
ADDRESS_ADMISSION_SHARE = 5
#: addresses whose admission bucket is kept at once (idle ones are forgotten first)
MAX_ADMISSION_ADDRESSES = 65536


class RoomRegistry:
    """All rooms of one server, and its admission rate limit for registrations (every room's
    registrations and resumes draw on one bucket: ``ServerLimits.register_rate_per_s`` and
    ``register_burst``)."""

    def __init__(self, jobs: dict[str, JobConfig], limits: ServerLimits, seed: int | None = None,
                 clock: Callable[[], float] = time.monotonic, any_rank_may_lead: bool = False) -> None:
        rng = random.Random(seed) if seed is not None else random.SystemRandom()
        self.rooms = {name: Room(name, job, limits, rng, clock, any_rank_may_lead=any_rank_may_lead)
                      for name, job in jobs.items()}
        self.admission = TokenBucket(limits.register_rate_per_s, limits.register_burst, time.monotonic())
        #: one address's share of admission: a fifth of the rate and half the burst (one client
        #: looping register-and-close took the whole server's rate, and other ranks' resumes
        #: were refused; a lab behind one NAT still gets 50 at once)
        self._admission_by_address: dict[str, TokenBucket] = {}
        self._address_rate = limits.register_rate_per_s / ADDRESS_ADMISSION_SHARE
        self._address_burst = max(1.0, limits.register_burst / 2)

    def admit(self, address: str | None, now: float) -> bool:
        """Spend one admission (a registration or resume) for ``address``: its own bucket first,
        then the server's (README "Limits"); False when either is empty (close 4029)."""
        key = client_key(address)
        b = self._admission_by_address.get(key)
        if b is None:
            if len(self._admission_by_address) >= MAX_ADMISSION_ADDRESSES:
                self._prune_admission(now)
            b = self._admission_by_address[key] = TokenBucket(self._address_rate, self._address_burst, now)
        if not b.take(1, now):
            return False
        if not self.admission.take(1, now):
            b.tokens += 1   # (refused by the server's bucket: this address's share is not spent)
            return False
        return True

    def _prune_admission(self, now: float) -> None:
        """Forget addresses whose bucket has refilled (they are as if never seen)."""
        for k, b in list(self._admission_by_address.items()):
            if b.tokens + (now - b.at) * b.rate >= b.burst:
                del self._admission_by_address[k]

    def get(self, name: str) -> Room | None:
        return self.rooms.get(name)

    def tick(self, now: float) -> None:
        """Periodic work: release expired ids, check duration stop conditions."""
        self._prune_admission(now)
        for room in self.rooms.values():
            room.expire(now)
            room.flush_roll_call(now)
            room.check_stalls(now)
            room.flush_pressure()
            room.check_stop(now)
