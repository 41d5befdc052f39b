"""Several ``tabcohort serve`` nodes as one cluster, coordinated through Redis (README, "Cluster").

Each room is owned by one node at a time; the owner relays its ranks. The engine is Redis (the
pattern LiveKit and Centrifugo use: nodes report themselves and their load to a shared store with
a TTL, a room's owner holds a lease there); nothing here is a consensus protocol of our own.

Keys (``PREFIX`` = ``tabcohort:``, in the URL's database):

- ``node:{id}``: JSON ``{id, url, load, rooms, owned}``, expiring after ``lease_ms`` unless the node
  refreshes it (its heartbeat, every ``tick_ms``); ``nodes``: the set of ids ever seen.
- ``lease:{room}``: ``"{node_id} {url}"``, set with ``SET NX PX lease_ms`` (the atomic claim),
  renewed and released by compare-and-set Lua scripts (:data:`RENEW_LUA`, :data:`RELEASE_LUA`), so
  only the holder extends or drops it (the single-instance lock of the Redis documentation,
  "Distributed Locks with Redis").
- ``room:{name}``: JSON the owner writes every tick (owner, url, stopped, ranks, step), kept
  ``ROOM_RECORD_LEASES`` leases; ``rooms``: the set of room names. ``/api/rooms`` on any node reads
  these.

Two parts: :class:`LeaseBook` is the pure decision logic (what this node holds, when it may claim
a room it did not own: time passes in as ``now_ms``), and :class:`ClusterNode` is the thin
redis-py asyncio adapter that runs one :meth:`ClusterNode.tick` every ``tick_ms``.

Failover bound: a room whose owner died has no lease at most ``lease_ms`` after its last renewal;
another node sees that within ``tick_ms`` and claims it ``takeover_ms`` (+ ``stagger_ms`` per less
loaded eligible node) later. So a room is owned again within
``lease_ms + tick_ms + takeover_ms + stagger_ms * (eligible nodes - 1)``. ``takeover_ms`` exists so
that an owner that lost Redis for a while re-asserts its rooms (at once) before anyone else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from tabcohort._urls import redact_url
from tabcohort.errors import ConfigError

log = logging.getLogger("tabcohort.server.cluster")

PREFIX = "tabcohort:"
#: a room record outlives its owner's last write by this many leases (listing of an orphan room)
ROOM_RECORD_LEASES = 10
#: WebSocket close code: the room is owned by another node; the reason is its base URL
CLOSE_MOVED = 4012
#: the longest ``--advertise-url``: ranks get it in a WebSocket close reason (4012), which the
#: server cuts at 120 bytes (a control frame's payload is at most 125 bytes, RFC 6455 5.5)
MAX_ADVERTISE_URL_BYTES = 120
#: WebSocket close code (RFC 6455 registry, "Try Again Later"): no node owns the room right now
CLOSE_TRY_AGAIN = 1013

#: KEYS[1] lease key, ARGV[1] holder value, ARGV[2] lease ms: extend only if we hold it
RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
#: KEYS[1] lease key, ARGV[1] holder value: delete only if we hold it
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def check_redis_url(url: object, flag: str = "--redis") -> str:
    """Validate a Redis URL (``redis://[user:pass@]HOST[:PORT][/DB]``, ``rediss://`` for TLS,
    ``unix:///path.sock``) without touching the network.

    Raises:
        ConfigError: naming ``flag`` and the URL, for another scheme, no host, a bad port or DB.
    """
    if not isinstance(url, str) or not url:
        raise ConfigError(flag, url, "expected a URL like redis://127.0.0.1:6379/0")
    try:
        u = urllib.parse.urlsplit(url)
    except ValueError as exc:             # e.g. an unclosed IPv6 bracket: redis://[::1
        raise ConfigError(flag, redact_url(url), f"not a URL ({exc}); expected e.g. redis://127.0.0.1:6379/0") from None
    if u.scheme == "unix":
        if not u.path:
            raise ConfigError(flag, redact_url(url), "a unix:// URL needs a socket path")
        return url
    if u.scheme not in ("redis", "rediss"):
        raise ConfigError(flag, redact_url(url), "expected a redis://HOST:PORT/DB (or rediss://, unix://) URL")
    if not u.hostname:
        raise ConfigError(flag, redact_url(url), "no host in the URL (e.g. redis://127.0.0.1:6379/0)")
    try:
        u.port
    except ValueError:
        raise ConfigError(flag, redact_url(url), "the port is not a number in 0..65535") from None
    db = u.path.lstrip("/")
    if db and not (db.isdigit() and int(db) < 1 << 16):
        raise ConfigError(flag, redact_url(url), f"the database {db!r} is not a number (e.g. /0)")
    return url


@dataclass(frozen=True)
class ClusterTiming:
    """Lease and heartbeat periods, milliseconds.

    Attributes:
        lease_ms: a room lease (and a node's heartbeat key) lives this long unless renewed.
        tick_ms: renew, heartbeat, observe and claim this often (at most ``lease_ms / 3``).
        takeover_ms: a room another node owned must have had no lease this long, as this node
            saw it, before this node claims it (its last owner re-asserts first).
        stagger_ms: added per eligible node with a lower load, so the least loaded claims first.
    """

    lease_ms: float = 5000.0
    tick_ms: float = 1000.0
    takeover_ms: float = 5000.0
    stagger_ms: float = 1000.0

    def validate(self) -> None:
        """Raise a ConfigError naming the flag and its real range (the lease >= 100 ms, the tick
        >= 10 ms and at most a third of the lease; each at most an hour)."""
        _check_ms("lease_ms", self.lease_ms, 100, 3_600_000)
        _check_ms("tick_ms", self.tick_ms, 10, self.lease_ms / 3, f"--cluster-lease-ms / 3 = {self.lease_ms / 3:g}")
        _check_ms("takeover_ms", self.takeover_ms, 0, 3_600_000)
        _check_ms("stagger_ms", self.stagger_ms, 0, 3_600_000)

    def failover_bound_ms(self, n_eligible: int = 2) -> float:
        """The longest a room of a dead owner stays unowned (module docstring)."""
        return self.lease_ms + self.tick_ms + self.takeover_ms + self.stagger_ms * max(0, n_eligible - 1)


def _check_ms(name: str, v: object, lo: float, hi: float, hi_text: str | None = None) -> None:
    """A ConfigError naming ``--cluster-NAME`` unless ``v`` is milliseconds in ``[lo, hi]``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ConfigError(f"--cluster-{name.replace('_', '-')}", v,
                          f"must be milliseconds in [{lo:.15g}, {hi_text or f'{hi:.15g}'}]")


def claim_rank(me: str, loads: dict[str, tuple[float, Iterable[str]]], room: str, my_load: float) -> int:
    """How many live nodes that can host ``room`` come before ``me`` (lower load, then lower id).

    Args:
        loads: node id -> (load, the rooms it can host), from the nodes' heartbeat records.
    """
    return sum(1 for k, (load, rooms) in loads.items()
               if k != me and room in set(rooms) and (load, k) < (my_load, me))


class LeaseBook:
    """What one node holds and when it may claim (pure: no Redis, no clock; ``now_ms`` in).

    Args:
        node_id: this node's id.
        timing: the cluster's periods.
    """

    def __init__(self, node_id: str, timing: ClusterTiming) -> None:
        self.node_id = node_id
        self.timing = timing
        #: room -> the time until which Redis confirmed our lease (ms, this node's clock)
        self.owned: dict[str, float] = {}
        #: room -> when this node first saw it without a lease (reset on any Redis error)
        self.absent_since: dict[str, float] = {}
        #: room -> the last owner id this node saw (Redis's record, or its own observation)
        self.last_owner: dict[str, str] = {}

    def holds(self, room: str) -> bool:
        """True while this node serves ``room`` (kept through a Redis outage: README "Cluster")."""
        return room in self.owned

    def unconfirmed(self, room: str, *, now_ms: float) -> bool:
        """Held, but Redis has not confirmed the lease for its whole length (an outage)."""
        return room in self.owned and now_ms > self.owned[room]

    def acquired(self, room: str, *, sent_ms: float) -> None:
        """A claim or renewal sent at ``sent_ms`` succeeded: the lease runs ``lease_ms`` from then."""
        self.owned[room] = sent_ms + self.timing.lease_ms
        self.absent_since.pop(room, None)
        self.last_owner[room] = self.node_id

    def lost(self, room: str, owner: str | None) -> bool:
        """Another node holds ``room`` (or nobody, after our lease lapsed). Returns whether we held it."""
        held = self.owned.pop(room, None) is not None
        if owner is not None:
            self.last_owner[room] = owner
        return held

    def observe(self, room: str, owner: str | None, *, now_ms: float, recorded_owner: str | None = None) -> None:
        """What Redis says of a room this node does not hold: its lease holder, or ``None``."""
        if recorded_owner is not None:
            self.last_owner.setdefault(room, recorded_owner)
        if owner is None:
            self.absent_since.setdefault(room, now_ms)
        else:
            self.absent_since.pop(room, None)
            self.last_owner[room] = owner

    def redis_failed(self) -> None:
        """Redis did not answer: absence seen so far no longer counts (held rooms are kept)."""
        self.absent_since.clear()

    def should_claim(self, room: str, *, now_ms: float, rank: int = 0) -> bool:
        """True if this node should try ``SET NX`` on ``room`` now.

        A room nobody is known to have owned (new) or that this node owned last is claimed at
        once; one another node owned only after ``takeover_ms + rank * stagger_ms`` without a lease.
        """
        if room in self.owned:
            return False
        t0 = self.absent_since.get(room)
        if t0 is None:
            return False
        last = self.last_owner.get(room)
        if last is None or last == self.node_id:
            return rank == 0 or now_ms - t0 >= rank * self.timing.stagger_ms
        return now_ms - t0 >= self.timing.takeover_ms + rank * self.timing.stagger_ms


@dataclass
class ClusterConfig:
    """A node's cluster settings (``tabcohort serve --redis``).

    Attributes:
        redis_url: ``redis://HOST:PORT/DB``.
        node_id: this node's id (unique in the cluster).
        advertise_url: the base URL other nodes send ranks and pages to (``http://host:port``).
        timing: lease and heartbeat periods.
        connect_timeout_s: bound on reaching Redis at start (then a ConfigError naming ``--redis``).
    """

    redis_url: str
    node_id: str
    advertise_url: str = ""
    timing: ClusterTiming = field(default_factory=ClusterTiming)
    connect_timeout_s: float = 3.0

    def validate(self) -> None:
        check_redis_url(self.redis_url)
        self.timing.validate()
        if not (isinstance(self.node_id, str) and 1 <= len(self.node_id) <= 64
                and all(c.isalnum() or c in "-_." for c in self.node_id)):
            raise ConfigError("--node-id", self.node_id, "1..64 characters of [A-Za-z0-9._-]")
        if self.advertise_url:
            try:
                u = urllib.parse.urlsplit(self.advertise_url)
            except ValueError:
                raise ConfigError("--advertise-url", redact_url(self.advertise_url), "expected http(s)://HOST[:PORT]") from None
            if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/"):
                raise ConfigError("--advertise-url", redact_url(self.advertise_url), "expected http(s)://HOST[:PORT]")
            if len(self.advertise_url.encode()) > MAX_ADVERTISE_URL_BYTES:
                # (it travels in a WebSocket close reason, 4012: 123 bytes at most, RFC 6455 5.5)
                raise ConfigError("--advertise-url", redact_url(self.advertise_url),
                                  f"at most {MAX_ADVERTISE_URL_BYTES} bytes (ranks are sent it in a close reason)")


class ClusterNode:
    """One node's membership: heartbeat, leases, owners of every room (redis-py asyncio).

    Args:
        config: the cluster settings (validated).
        local_rooms: the rooms this node can host -> a callable giving its record fields
            (``stopped``, ``token``, ``n_connected``, ``step``, ``job_hash``).
        on_acquire: called with ``(room, held_before)`` when this node starts owning it (load its
            checkpoint): ``held_before`` when the room's record named an owner, whose ranks may
            come back (a room no node ever held has none to wait for).
        on_release: called with ``(room, owner_url or None)`` when it stops owning it.
        load: this node's load (connected ranks), read every tick.
    """

    def __init__(self, config: ClusterConfig, local_rooms: dict[str, Callable[[], dict]],
                 on_acquire: Callable[[str, bool], None], on_release: Callable[[str, str | None], None],
                 load: Callable[[], float]) -> None:
        self.config = config
        self.timing = config.timing
        self.book = LeaseBook(config.node_id, config.timing)
        self.local_rooms = local_rooms
        self.on_acquire = on_acquire
        self.on_release = on_release
        self.load = load
        #: room -> (owner id, owner url) as last seen (used to redirect during a Redis outage)
        self.owners: dict[str, tuple[str, str]] = {}
        self.redis_up = False
        self.redis_errors = 0
        self.redis_down_since: float | None = None
        self.counters = {"claims": 0, "renewals": 0, "lost": 0, "released": 0, "redirects": 0,
                         "reasserted": 0, "ticks": 0, "job_mismatch": 0}
        self._mismatch_said: set[str] = set()   # rooms whose job mismatch was logged
        #: room -> the URLs of the other live nodes that can host it (from the last tick)
        self.hosts: dict[str, list[str]] = {}
        self._redis: Any = None
        self._renew: Any = None
        self._release: Any = None
        self._task: asyncio.Task | None = None

    @property
    def value(self) -> str:
        """This node's lease value: ``"{node_id} {advertise_url}"``."""
        return f"{self.config.node_id} {self.config.advertise_url}"

    # ------------------------------------------------------------------ lifecycle
    async def connect(self) -> None:
        """Open the client and check Redis answers (PING), before the node serves anything.

        Raises:
            ConfigError: naming ``--redis``: unreachable, refused, or not a Redis server.
        """
        import redis.asyncio as aredis
        from redis.exceptions import RedisError

        t = self.config.connect_timeout_s
        tick_s = self.timing.tick_ms / 1000.0
        try:
            self._redis = aredis.from_url(self.config.redis_url, socket_connect_timeout=min(t, max(tick_s, 0.5)),
                                          socket_timeout=max(tick_s, 0.5), decode_responses=True)
            await asyncio.wait_for(self._redis.ping(), t)
        except (RedisError, OSError, asyncio.TimeoutError, ValueError) as exc:
            if self._redis is not None:
                await self._redis.aclose()
            raise ConfigError("--redis", redact_url(self.config.redis_url),
                              f"Redis does not answer ({type(exc).__name__}: {exc})") from None
        self._renew = self._redis.register_script(RENEW_LUA)
        self._release = self._redis.register_script(RELEASE_LUA)
        self.redis_up = True

    async def start(self) -> None:
        """First tick (claims the rooms nobody holds), then tick every ``tick_ms`` in a held task.

        Raises:
            ConfigError: naming ``--node-id``: a live node at another URL has this id (two
                nodes with one id overwrote each other's record, and the node list was wrong).
        """
        from redis.exceptions import RedisError
        try:
            other = _obj(await self._redis.get(PREFIX + "node:" + self.config.node_id)) or {}
        except RedisError:
            other = {}    # (Redis down: the outage path takes over at the first tick)
        url = other.get("url")
        if isinstance(url, str) and url.rstrip("/") != self.config.advertise_url.rstrip("/"):
            raise ConfigError("--node-id", self.config.node_id,
                              f"a live node at {url} has this id: give each node its own (if that node "
                              f"has just stopped, its record expires within {self.timing.lease_ms:g} ms)")
        await self.tick()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        period = self.timing.tick_ms / 1000.0
        loop = asyncio.get_running_loop()
        next_t = loop.time()
        while True:
            next_t += period
            await asyncio.sleep(max(0.0, next_t - loop.time()))
            try:
                await self.tick()
            except Exception:  # pragma: no cover - keep the node serving, but say so
                log.exception("cluster tick failed")
            next_t = max(next_t, loop.time() - period)

    async def aclose(self, *, release: bool = True) -> None:
        """Stop ticking; release our leases (so another node takes over at once) and leave."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._redis is None:
            return
        from redis.exceptions import RedisError
        try:
            if release:
                for room in list(self.book.owned):
                    await self._release(keys=[PREFIX + "lease:" + room], args=[self.value])
                    self.counters["released"] += 1
                await self._redis.delete(PREFIX + "node:" + self.config.node_id)
        except (RedisError, OSError, asyncio.TimeoutError):
            pass
        await self._redis.aclose()

    # ------------------------------------------------------------------ queries
    def owns(self, room: str) -> bool:
        return self.book.holds(room)

    def owner_url(self, room: str) -> str | None:
        """The base URL of the node that owns ``room`` (last seen), or ``None``."""
        o = self.owners.get(room)
        return o[1] or None if o else None

    async def lookup_owner(self, room: str) -> str | None:
        """The owner's base URL of any room of the cluster (one GET for a room not hosted here)."""
        if room in self.local_rooms:
            return self.owner_url(room)
        from redis.exceptions import RedisError
        try:
            cur = await self._redis.get(PREFIX + "lease:" + room)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self._failed(exc)
            return None
        return (cur or "").partition(" ")[2] or None

    def _now_ms(self) -> float:
        return time.monotonic() * 1000.0

    def _failed(self, exc: BaseException) -> None:
        self.redis_errors += 1
        if self.redis_up:
            log.warning("cluster: Redis unreachable (%s: %s); rooms keep running", type(exc).__name__, exc)
            self.redis_down_since = time.monotonic()
        self.redis_up = False
        self.book.redis_failed()

    # ------------------------------------------------------------------ one tick
    async def tick(self) -> None:
        """Heartbeat, renew held leases, observe the others, claim what is due, publish records."""
        from redis.exceptions import RedisError

        self.counters["ticks"] += 1
        r = self._redis
        lease_ms = int(self.timing.lease_ms)
        try:
            sent = self._now_ms()
            node = {"id": self.config.node_id, "url": self.config.advertise_url, "load": self.load(),
                    "rooms": sorted(self.local_rooms), "owned": sorted(self.book.owned)}
            await r.set(PREFIX + "node:" + self.config.node_id, json.dumps(node), px=lease_ms)
            await r.sadd(PREFIX + "nodes", self.config.node_id)
            if not self.redis_up:
                log.warning("cluster: Redis is back; re-asserting %d room(s)", len(self.book.owned))
                self.redis_up, self.redis_down_since = True, None
            loads = await self._loads()
            for room in sorted(self.local_rooms):
                key = PREFIX + "lease:" + room
                if self.book.holds(room):
                    sent = self._now_ms()
                    if await self._renew(keys=[key], args=[self.value, lease_ms]):
                        self.book.acquired(room, sent_ms=sent)
                        self.counters["renewals"] += 1
                        continue
                    cur = await r.get(key)
                    if cur is None and await r.set(key, self.value, nx=True, px=lease_ms):
                        self.book.acquired(room, sent_ms=sent)   # lapsed or Redis restarted: ours again
                        self.counters["reasserted"] += 1
                        continue
                    if cur is None:
                        cur = await r.get(key)
                    owner_id, _, url = (cur or "").partition(" ")
                    self.book.lost(room, owner_id or None)
                    self.counters["lost"] += 1
                    if cur:
                        self.owners[room] = (owner_id, url)
                    log.warning("cluster: node %s lost room %s to %s", self.config.node_id, room, cur)
                    self.on_release(room, url or None)
                    continue
                cur = await r.get(key)
                rec = await r.get(PREFIX + "room:" + room)
                recd = _obj(rec) or {}
                recorded = recd.get("owner")
                their_hash = recd.get("job_hash")
                now = self._now_ms()
                self.book.observe(room, cur.split(" ", 1)[0] if cur else None, now_ms=now,
                                  recorded_owner=recorded if isinstance(recorded, str) else None)
                if cur:
                    k, _, url = cur.partition(" ")
                    self.owners[room] = (k, url)
                    continue
                self.owners.pop(room, None)
                if isinstance(their_hash, str) and their_hash != self.local_rooms[room]().get("job_hash"):
                    self.counters["job_mismatch"] += 1   # another job under this name: not ours to serve
                    if room not in self._mismatch_said:
                        # (said once: a node that will never host the room it was given said
                        # nothing, and the room stayed without an owner; a new-user trial)
                        self._mismatch_said.add(room)
                        log.warning("cluster: node %s will not take over room %s: the room's job there "
                                    "(job hash %.16s) is not this node's (%.16s); start the nodes with the "
                                    "same room settings (--hidden, --local-steps, --job, ...)",
                                    self.config.node_id, room, their_hash,
                                    str(self.local_rooms[room]().get("job_hash")))
                    continue
                rank = claim_rank(self.config.node_id, loads, room, self.load())
                if self.book.should_claim(room, now_ms=now, rank=rank):
                    sent = self._now_ms()
                    if await r.set(key, self.value, nx=True, px=lease_ms):
                        self.book.acquired(room, sent_ms=sent)
                        self.counters["claims"] += 1
                        self.owners[room] = (self.config.node_id, self.config.advertise_url)
                        log.warning("cluster: node %s owns room %s", self.config.node_id, room)
                        self.on_acquire(room, isinstance(recorded, str))
            for room in self.book.owned:
                rec = dict(self.local_rooms[room](), room=room, owner=self.config.node_id,
                           url=self.config.advertise_url)
                self.owners[room] = (self.config.node_id, self.config.advertise_url)
                await r.set(PREFIX + "room:" + room, json.dumps(rec), px=lease_ms * ROOM_RECORD_LEASES)
                await r.sadd(PREFIX + "rooms", room)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self._failed(exc)

    async def _loads(self) -> dict[str, tuple[float, list[str]]]:
        ids = sorted(await self._redis.smembers(PREFIX + "nodes"))
        if not ids:
            return {}
        vals = await self._redis.mget([PREFIX + "node:" + k for k in ids])
        out: dict[str, tuple[float, list[str]]] = {}
        hosts: dict[str, list[str]] = {}
        for k, v in zip(ids, vals):
            d = _obj(v)
            if d is None:
                continue
            load = d.get("load")
            rooms = d.get("rooms")
            out[k] = (float(load) if isinstance(load, (int, float)) and not isinstance(load, bool) else 0.0,
                      [x for x in rooms if isinstance(x, str)] if isinstance(rooms, list) else [])
            url = d.get("url")
            if k != self.config.node_id and isinstance(url, str):
                for room in out[k][1]:
                    hosts.setdefault(room, []).append(url)
        self.hosts = hosts
        return out

    async def rooms(self) -> list[dict] | None:
        """Every room of the cluster with its owner: the records owners publish, the leases,
        and the rooms this node can host; ``None`` when Redis does not answer."""
        from redis.exceptions import RedisError
        try:
            names = set(await self._redis.smembers(PREFIX + "rooms")) | set(self.local_rooms)
            names = sorted(n for n in names if isinstance(n, str))
            if not names:
                return []
            recs = await self._redis.mget([PREFIX + "room:" + n for n in names])
            leases = await self._redis.mget([PREFIX + "lease:" + n for n in names])
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self._failed(exc)
            return None
        out = []
        for name, rec, lease in zip(names, recs, leases):
            d = _obj(rec) or {}
            owner, _, url = (lease or "").partition(" ")
            out.append({"room": name, "owner": owner or None, "owner_url": url or None,
                        "stopped": bool(d.get("stopped")), "token": bool(d.get("token")),
                        **({"n_connected": d["n_connected"]} if not d.get("token") and isinstance(
                            d.get("n_connected"), int) else {}),
                        "here": name in self.local_rooms})
        return out

    async def nodes(self) -> list[dict] | None:
        """The live nodes (their heartbeat records); ``None`` when Redis does not answer."""
        from redis.exceptions import RedisError
        try:
            ids = sorted(await self._redis.smembers(PREFIX + "nodes"))
            vals = await self._redis.mget([PREFIX + "node:" + k for k in ids]) if ids else []
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self._failed(exc)
            return None
        return [d for d in (_obj(v) for v in vals) if d is not None]

    # ------------------------------------------------------------------ metrics
    def collector(self) -> "ClusterCollector":
        return ClusterCollector(self)


def _obj(v: object) -> dict | None:
    if not isinstance(v, str):
        return None
    try:
        d = json.loads(v)
    except ValueError:
        return None
    return d if isinstance(d, dict) else None


class ClusterCollector:
    """Prometheus series of a cluster node (scraped with the rooms' series at ``/metrics``)."""

    def __init__(self, node: ClusterNode) -> None:
        self.node = node

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        n = self.node
        now = n._now_ms()
        yield GaugeMetricFamily("tabcohort_cluster_redis_up", "1 while this node reaches Redis",
                                value=1.0 if n.redis_up else 0.0)
        down = 0.0 if n.redis_down_since is None else time.monotonic() - n.redis_down_since
        yield GaugeMetricFamily("tabcohort_cluster_redis_down_seconds", "Seconds since Redis stopped answering "
                                "(0 while it answers)", value=down)
        yield CounterMetricFamily("tabcohort_cluster_redis_errors", "Redis calls that failed", value=n.redis_errors)
        owned = GaugeMetricFamily("tabcohort_cluster_room_owned", "1 if this node owns (serves) the room",
                                  labels=["room"])
        unconf = GaugeMetricFamily("tabcohort_cluster_lease_unconfirmed", "1 if this node serves the room but "
                                   "Redis has not confirmed its lease (an outage)", labels=["room"])
        for room in sorted(n.local_rooms):
            owned.add_metric([room], 1.0 if n.owns(room) else 0.0)
            unconf.add_metric([room], 1.0 if n.book.unconfirmed(room, now_ms=now) else 0.0)
        yield owned
        yield unconf
        c = CounterMetricFamily("tabcohort_cluster_events", "Lease events of this node", labels=["event"])
        for k, v in sorted(n.counters.items()):
            c.add_metric([k], v)
        yield c
