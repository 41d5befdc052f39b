"""The room client: one rank's side of the server's relay protocol, sans-I/O.

No event loop, no sockets: the star and mesh buses (:mod:`tabcohort.bus.star`,
:mod:`tabcohort.bus.mesh`) feed it what their socket adapter saw, with ``now_ms``, and do what
it returns (docs/INTERFACES.md, "Bus" and "Close codes"; PROTOCOL.md, "Bus contract").

What it keeps:

- the registration (``register`` with ``token``, ``trainer_token`` and, on a reconnect,
  ``resume: {id, secret}``) and what ``welcome`` says (``id``, ``secret``, ``peers``,
  ``may_lead``, ``lead_peers``);
- the peer table from ``welcome`` and ``peer`` (``id``, ``up``, ``may_lead``) controls, with the
  role the server bound to this link and to each peer (docs/PROTOCOL.md, "Roles"); the relay's
  ``pressure`` (``p``) and the room's ``stop`` (``reason``);
- where the room is served: a cluster node that does not own the room closes with 4012 and the
  owner's base URL as the reason; the bus follows it (at most :data:`MAX_MOVES` times per
  attempt) and, when a node it was moved to does not answer, asks its entry URL again
  (docs/INTERFACES.md, "Close codes");
- per-peer chunk bytes (a broadcast counts once per known peer: what the relay forwards);
- the send-queue bound (a post beyond ``max_queue_bytes`` is dropped, ``send_overflow``; a post
  while disconnected is dropped, ``disconnected``);
- reconnect backoff as deadlines: after a lost socket, :meth:`RoomClient.lost` says when to try
  again (full jitter, :mod:`tabcohort.bus.backoff`) or that the bus is done (close codes as in
  docs/INTERFACES.md, "Close codes": 4000, 4001, 4009 end it; 4004 on a resume ends it with
  ``rejoin``; anything else, 4029, 1013 and 4011 included, is retried until ``reconnect_max_s``;
  a first registration is retried only after 4029 or 1013);
- the receive ``backlog`` a rank that cannot pause its socket reports (held bytes, sent when
  they moved by >= 1/8 of the high-water mark or went to or from 0).

Server controls that are not well-formed are dropped and counted (``bad_control``), never
raised.
"""

from __future__ import annotations

import random
import urllib.parse
from typing import Any

from ..errors import ConfigError, TabcohortError
from .backoff import full_jitter_s
from .base import ByteCounts, LinkBytes

DEFAULT_HIGH_WATER_BYTES = 1 << 20
#: The send queue bound: beyond it new posts are dropped (``send_overflow``).
DEFAULT_MAX_QUEUE_BYTES = 64 << 20
CLOSE_BAD_REGISTER = 4000
CLOSE_BAD_TOKEN = 4001
CLOSE_UNKNOWN_ID = 4004
CLOSE_ROOM_FULL = 4009
#: the server's admission rate limit: registrations beyond it are closed with this; retry later
CLOSE_RETRY_LATER = 4029
#: a cluster node that does not own the room: the close reason is the owner's base URL
CLOSE_MOVED = 4012
#: RFC 6455 "Try Again Later": a cluster has no owner for the room right now (a failover)
CLOSE_TRY_AGAIN = 1013
RETRY_CLOSE = frozenset({CLOSE_RETRY_LATER, CLOSE_TRY_AGAIN})
FATAL_CLOSE = frozenset({CLOSE_BAD_REGISTER, CLOSE_BAD_TOKEN, CLOSE_UNKNOWN_ID, CLOSE_ROOM_FULL})
#: how long a rank tries to reconnect (or retries a rate-limited registration) before it gives
#: up, seconds (``RoomClient(reconnect_max_s=...)``); a restarted server's partial roll call
#: lasts at least this long (PROTOCOL.md, "Membership and majority")
RECONNECT_MAX_S = 30.0
#: the last reconnect attempt comes within this long (ms) before the bound (RoomClient.lost)
LAST_ATTEMPT_SPREAD_MS = 2_000.0
#: node-to-node redirects followed per connection attempt
MAX_MOVES = 4


#: other nodes' URLs kept from a ``welcome`` (``RoomClient.alternates``)
MAX_ALTERNATES = 16


def moved_ws_url(current: str, owner_base: str) -> str | None:
    """The room's WebSocket URL at ``owner_base`` (``http(s)://host:port``, a 4012 close reason),
    keeping ``current``'s path and query; ``None`` for anything that is not such a URL, and for
    an ``http`` node when ``current`` is ``wss``: a rank's register carries its tokens, which
    would then go in clear."""
    o = urllib.parse.urlsplit(owner_base.strip())
    if o.scheme not in ("http", "https") or not o.hostname or o.path not in ("", "/") or o.query:
        return None
    if urllib.parse.urlsplit(current).scheme == "wss" and o.scheme != "https":
        return None
    try:
        o.port
    except ValueError:
        return None
    c = urllib.parse.urlsplit(current)
    scheme = "wss" if o.scheme == "https" else "ws"
    return urllib.parse.urlunsplit((scheme, o.netloc, c.path, c.query, ""))


def http_base(ws_url: str) -> str:
    """``http(s)://host:port`` of a ``ws(s)://`` URL (the node a bus is linked to)."""
    u = urllib.parse.urlsplit(ws_url)
    return urllib.parse.urlunsplit(("https" if u.scheme == "wss" else "http", u.netloc, "", "", ""))


class LinkFailed(TabcohortError):
    """The link to the server is gone for good (bad token, id no longer reserved, gave up).

    Attributes:
        code: the server's WebSocket close code, when it closed the link (else ``None``).
        reason: the close reason (for 4012: the base URL of the node that owns the room).
    """

    def __init__(self, message: str, code: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: controls a room bus gives its owner of its own accord, never read from the server
LOCAL_CONTROLS = frozenset({"unreachable", "failed"})


class RoomClient:
    """One rank's relay-protocol state (see the module docstring). Sans-I/O.

    Args:
        url: the room's WebSocket URL this rank was given (its entry node in a cluster).
        token: the room token, if any.
        trainer_token: the room's trainer credential, if any (docs/PROTOCOL.md, "Roles").
        high_water_bytes: queued bytes at which :meth:`pressure` reaches 1.
        max_queue_bytes: the send-queue bound.
        reconnect_max_s: give up reconnecting (or retrying a rate-limited registration) after
            this long, seconds.
        rng: this rank's backoff generator (default: a fresh ``random.Random()``).

    Raises:
        ConfigError: a bound that is not a positive int.
    """

    def __init__(self, url: str = "", *, token: str | None = None, trainer_token: str | None = None,
                 high_water_bytes: int = DEFAULT_HIGH_WATER_BYTES,
                 max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES, reconnect_max_s: float = RECONNECT_MAX_S,
                 rng: random.Random | None = None) -> None:
        for name, v in (("high_water_bytes", high_water_bytes), ("max_queue_bytes", max_queue_bytes)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(name, v, "must be a positive int")
        if not (_is_number(reconnect_max_s) and reconnect_max_s >= 0):
            raise ConfigError("reconnect_max_s", reconnect_max_s, "must be a number of seconds >= 0")
        self.token = token
        self.trainer_token = trainer_token
        #: the URL to open next (a cluster moves it to the room's owner) and the one given,
        #: which a reconnect that cannot reach the owner asks again to learn the new one
        self.url = url
        self.entry_url = url
        self._known_nodes: list[str] = []     # every node a welcome named or came from, newest first
        self.n_moves = 0          # cluster redirects followed (4012)
        self._moves = 0           # ... in this attempt
        self._dead: set[str] = set()
        #: the role the server bound to this link, and the peers' (id -> may lead)
        self.may_lead = False
        self.lead_roles: dict[int, bool] = {}
        self.high_water_bytes = high_water_bytes
        self.max_queue_bytes = max_queue_bytes
        self.reconnect_max_ms = float(reconnect_max_s) * 1000.0
        self.rng = rng or random.Random()
        self.id = 0
        self.secret: str | None = None
        self.peers: set[int] = set()
        self.connected = False
        self.relay_pressure = 0.0
        self.stopped_reason: str | None = None
        #: why the bus gave up for good, and whether the runtime may join again as a new rank
        self.failed: str | None = None
        self.rejoin = False
        self.n_reconnects = 0
        self.counts = ByteCounts()
        self.drops: dict[str, int] = {}
        self._resuming = False
        self._attempt = 0
        self._give_up_ms: float | None = None
        self._last_attempt = False        # the one attempt within the bound's final spread is drawn
        self._lost_at_ms = 0.0            # when the link was lost (the give-up message says how long ago)
        self._backlog_sent = 0

    @property
    def alternates(self) -> list[str]:
        """The room's WebSocket URLs at the cluster's other nodes that can host it (from the
        ``welcome``'s ``nodes``, merged across welcomes), newest first, at most ``MAX_ALTERNATES``:
        asked when neither the node it was at nor the entry URL answers."""
        return [u for u in self._known_nodes if u != self.url][:MAX_ALTERNATES]

    # ------------------------------------------------------------------ registration
    def register(self) -> dict:
        """The first control on a new socket: ``register`` (a resume once this rank has an id)."""
        reg: dict[str, Any] = {"type": "register", "version": 1}
        if self.token is not None:
            reg["token"] = self.token
        if self.trainer_token is not None:
            reg["trainer_token"] = self.trainer_token
        if self._resuming:
            reg["resume"] = {"id": self.id, "secret": self.secret}
        return reg

    @property
    def resuming(self) -> bool:
        """``True`` between a lost socket and the ``welcome`` that resumed this id."""
        return self._resuming

    def control(self, obj: Any) -> dict | None:
        """A control from the server (decoded JSON). Returns it when it is well-formed (for the
        bus owner's ``on_control``), else ``None`` (counted ``bad_control``)."""
        if not isinstance(obj, dict):
            self.count("bad_control")
            return None
        t = obj.get("type")
        if t == "welcome":
            try:
                rid, secret = obj["id"], obj["secret"]
                peers = {int(k) for k in obj.get("peers", ())}
                leads = {k for k in obj.get("lead_peers", ()) if isinstance(k, int) and not isinstance(k, bool)}
                if not isinstance(rid, int) or isinstance(rid, bool) or not isinstance(secret, str):
                    raise TypeError
            except (KeyError, TypeError, ValueError):
                self.count("bad_control")
                return None
            if self._resuming:
                self.n_reconnects += 1
            self.id, self.secret, self.peers = rid, secret, peers - {rid}
            nodes = obj.get("nodes")
            if isinstance(nodes, list):
                alts = [moved_ws_url(self.url, u) for u in nodes[:MAX_ALTERNATES] if isinstance(u, str) and len(u) <= 200]
                # merged with the nodes named before, this one's first (and the node that welcomed
                # it: it may come back): a welcome after a failover names only the survivors, and
                # a rank that kept just those gave up when the last of them died although the
                # first owner, restarted, had taken the room back (a new-user trial)
                known = dict.fromkeys([self.url, *(u for u in alts if u is not None), *self._known_nodes])
                self._known_nodes = list(known)[:MAX_ALTERNATES + 1]
            self.may_lead = obj.get("may_lead") is True
            self.lead_roles = {k: k in leads for k in self.peers}
            self.connected, self._resuming, self._attempt, self._give_up_ms = True, False, 0, None
            self._last_attempt = False
        elif t == "peer":
            k = obj.get("id")
            if not isinstance(k, int) or isinstance(k, bool):
                self.count("bad_control")
                return None
            if k != self.id:
                (self.peers.add if obj.get("up") else self.peers.discard)(k)
                if obj.get("up"):
                    self.lead_roles[k] = obj.get("may_lead") is True
                else:
                    self.lead_roles.pop(k, None)
        elif t == "roll_call":
            # the whole roll call, after a partial one (PROTOCOL.md, "Membership and majority")
            try:
                listed = {int(k) for k in obj["peers"] if isinstance(k, int) and not isinstance(k, bool)}
            except (KeyError, TypeError, ValueError):
                self.count("bad_control")
                return None
            self.peers = listed - {self.id}
            self.lead_roles = {k: v for k, v in self.lead_roles.items() if k in self.peers}
        elif t == "pressure":
            p = obj.get("p")
            if not _is_number(p):
                self.count("bad_control")
                return None
            self.relay_pressure = float(p)
        elif t == "stop":
            self.stopped_reason = str(obj.get("reason"))
        elif t in LOCAL_CONTROLS:
            # the bus's own word to its owner (``unreachable``, ``failed``), never the server's:
            # one over the wire would take peers out of the machine's view or end the seat
            self.count("bad_control")
            return None
        return obj

    # ------------------------------------------------------------------ sending
    def admit(self, size: int, queued_bytes: int) -> bool:
        """May a frame of ``size`` bytes be queued behind ``queued_bytes``? Counts a refusal."""
        if not self.connected:
            self.count("disconnected")
            return False
        if queued_bytes + size > self.max_queue_bytes:
            self.count("send_overflow")
            return False
        return True

    def count_sent(self, to: int | None, size: int) -> None:
        """``size`` chunk bytes went to the relay for ``to`` (``None``: every known peer)."""
        self.counts.add_sent((to,) if to is not None else self.peers, size)

    def count_received(self, sender: int, size: int) -> None:
        self.counts.add_received(sender, size)

    def bytes(self) -> dict[int, LinkBytes]:
        return self.counts.links()

    def pressure(self, queued_bytes: int) -> float:
        """``max(queued_bytes / high_water_bytes, the relay's pressure)``."""
        return max(queued_bytes / self.high_water_bytes, self.relay_pressure)

    def backlog(self, held_bytes: int) -> dict | None:
        """The ``backlog`` control to send now for ``held_bytes`` held unconsumed, or ``None``."""
        last = self._backlog_sent
        if (held_bytes == 0) == (last == 0) and abs(held_bytes - last) < self.high_water_bytes // 8:
            return None
        if not self.connected:
            return None
        self._backlog_sent = held_bytes
        return {"type": "backlog", "bytes": held_bytes}

    def count(self, reason: str, n: int = 1) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + n

    # ------------------------------------------------------------------ where the room is
    def new_attempt(self) -> str:
        """A connection attempt begins: the URL to open (redirect bookkeeping starts afresh)."""
        self._moves, self._dead = 0, set()
        return self.url

    def redirect(self, code: int | None, reason: str, *, reached: bool) -> tuple[str | None, int | None]:
        """A socket of the current attempt closed before ``welcome`` (``reached``: it opened).

        Returns:
            ``(url, code)``: ``url`` to open at once within this attempt (the owner a 4012 names,
            or the entry URL when a node it was moved to does not answer), else ``None``; and the
            close code to handle otherwise (1013 when the owner named is one that did not
            answer, or after :data:`MAX_MOVES` moves).
        """
        if code == CLOSE_MOVED:
            to = moved_ws_url(self.url, reason)
            if to is None:
                return None, code
            if to in self._dead or self._moves >= MAX_MOVES:
                return None, CLOSE_TRY_AGAIN   # the entry node still names the owner that died
            self.url, self._moves, self.n_moves = to, self._moves + 1, self.n_moves + 1
            return to, code
        if code is None and not reached:
            # the node did not answer: the entry URL (it learns the new owner), then the other
            # nodes the room's welcome named (the entry may be the owner that died: README
            # "Cluster"), each once per attempt
            self._dead.add(self.url)
            for to in [self.entry_url, *self.alternates]:
                if to not in self._dead:
                    self.url = to
                    return to, code
        return None, code

    def moved(self, reason: str) -> None:
        """A linked socket closed with 4012: the next attempt goes to the owner it names."""
        to = moved_ws_url(self.url, reason)
        if to is not None:
            self.url, self.n_moves = to, self.n_moves + 1

    # ------------------------------------------------------------------ losing the socket
    def refused(self, code: int | None, *, now_ms: float) -> float | None:
        """The first registration was refused with ``code``: when to try again (a deadline,
        ms; only for 4029 and 1013 within ``reconnect_max_s``), or ``None`` to give up."""
        if self._give_up_ms is None:
            self._give_up_ms = now_ms + self.reconnect_max_ms
        if code not in RETRY_CLOSE:
            return None
        return self._next_attempt_ms(now_ms)

    def lost(self, code: int | None, *, now_ms: float, reason: str = "") -> float | None:
        """The socket closed (``code`` from the server, ``None`` for a network error; ``reason``
        the server's close reason), or a reconnect attempt failed: the deadline (ms) of the next
        attempt, or ``None`` when the bus is done (then :attr:`failed` says why, and
        :attr:`rejoin` whether to join anew)."""
        first = not self._resuming
        self.connected = False
        self.relay_pressure = 0.0
        self._backlog_sent = 0
        if first:
            self._resuming, self._attempt, self._last_attempt = True, 0, False
            self._give_up_ms = now_ms + self.reconnect_max_ms
            self._lost_at_ms = now_ms
        if code in FATAL_CLOSE:
            # a resume the server refuses (4004: the grace expired, or it restarted without its
            # checkpoint directory) lets the runtime join again as a new rank
            why = f"server closed the link: code {code}" + (f" ({reason})" if reason else "")
            if code == CLOSE_BAD_TOKEN and not first:
                # the token was good until the link was lost: the server changed, not the rank
                why += ("; the token was accepted before the link was lost: a server restarted "
                        "without --checkpoint-dir or --trainer-token makes a new trainer token, so "
                        "start this rank again with the one it prints (README \"Roles\")")
            self.fail(why, rejoin=not first and code == CLOSE_UNKNOWN_ID)
            return None
        at = self._next_attempt_ms(now_ms)
        if at is None:
            away_s = (now_ms - self._lost_at_ms) / 1000.0
            self.fail(f"gave up reconnecting after {away_s:.0f} s without the server (the "
                      f"{self.reconnect_max_ms / 1000.0:g} s bound)")
            return None
        return at

    def fail(self, why: str, *, rejoin: bool = False) -> dict:
        """The bus is done; returns the ``failed`` control for the owner's ``on_control``."""
        if self.failed is None:
            self.failed, self.rejoin = why, rejoin
        self.connected = False
        return {"type": "failed", "reason": self.failed, "rejoin": self.rejoin}

    def _next_attempt_ms(self, now_ms: float) -> float | None:
        """The next attempt's deadline (full jitter), or ``None`` past the bound. When the draw
        passes the bound, one last attempt comes within its final :data:`LAST_ATTEMPT_SPREAD_MS`
        (uniform, so ranks that lost one server do not all come back at one instant): a rank
        whose draw passed it gave up 22 s after its link was lost, and three ranks whose server
        was back at 25-30 s exited and lost every step since the last checkpoint (a fault
        campaign)."""
        at = now_ms + self._next_delay_ms()
        if self._give_up_ms is None or at <= self._give_up_ms:
            return at
        if now_ms >= self._give_up_ms or self._last_attempt:
            return None
        self._last_attempt = True
        lo = max(now_ms, self._give_up_ms - LAST_ATTEMPT_SPREAD_MS)
        return lo + self.rng.random() * (self._give_up_ms - lo)

    def _next_delay_ms(self) -> float:
        d = full_jitter_s(self._attempt, self.rng) * 1000.0
        self._attempt += 1
        return d

