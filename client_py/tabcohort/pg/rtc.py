"""WebRTC links for a process group: data channels negotiated through a ``tabcohort serve``.

Used when a server is given (``PG_SERVER`` + ``PG_ROOM``): every rank joins the room's WebSocket
and :class:`~tabcohort.bus.mesh.MeshBus` opens an aiortc data channel (ordered, reliable) to
every other rank in the room, signalled through the server. The server assigns bus ids
(random uint32); :class:`RtcGroupBus` maps them to group ranks with a hello exchange and then
looks to :class:`~tabcohort.pg.group.ProcessGroup` like :class:`~tabcohort.pg.tcp.TcpBus`:
``post(msg, precision=)`` with ``msg["to"]`` a rank, ``on_message`` with ``msg["from"]`` a rank,
``on_peer_lost(rank, detail)``.

Hello exchange: each rank sends every room peer a ``hello`` whose ``job`` names the group
(version, world size, topology, ``PG_GROUP``), ``batch`` its rank, and ``ready`` whether it has
already heard that peer's hello (an acknowledgement). A hello with ``ready`` false is answered;
a peer that has not acknowledged is sent the hello again every :data:`HELLO_RESEND_S` while
bring-up lasts (a hello queued on a channel that then failed is lost). Bring-up ends when all
``WORLD - 1`` other ranks are known, have acknowledged, and their links are no longer
connecting. A room peer of another group (another ``job``) is ignored; a second claim to a rank
of this group fails bring-up at once, after this rank's hello has reached the claimant (bounded
by :data:`CLASH_FLUSH_S`), so that the claimant fails with the same error instead of waiting.

Paths: a pair whose channel is not open within :data:`CHANNEL_OPEN_TIMEOUT_S` (or fails later)
goes through the server relay (the mesh bus's fallback), so the group still works; the rank logs
it and :meth:`RtcGroupBus.links` / :meth:`RtcGroupBus.transport_bytes` show it. Idle links are
never moved to the relay (a group may sit between collectives for any time).

Loss: the server announces a peer whose WebSocket closed (a crashed or killed process closes
it at once) as ``{"type": "peer", "up": false}``; a known rank announced so is reported through
``on_peer_lost`` (the group raises :class:`~tabcohort.pg.errors.PeerLostError`). A rank whose
socket merely blipped is reported too: a fixed group does not wait for it. So is a data channel
that fails after bring-up (the mesh bus then moves the pair to the relay, but what was queued or
in flight on the channel is lost, and a collective would otherwise wait for its timeout).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from ..bus.base import LinkBytes
from ..bus.path import PathState
from ..wire import FrameWriter, WireLimits
from .config import PGConfig
from .errors import GroupSetupError
from .tcp import PG_VERSION

log = logging.getLogger("tabcohort.pg.rtc")

#: A pair whose data channel is not open after this long uses the server relay.
CHANNEL_OPEN_TIMEOUT_S = 10.0
#: Bring-up resends a hello to a peer that has not acknowledged this often.
HELLO_RESEND_S = 0.5
#: A rank that finds a second claimant of a rank waits at most this long for its own hello to
#: reach that claimant before it leaves, so both processes fail with the same clear error.
CLASH_FLUSH_S = 3.0


def group_tag(cfg: PGConfig) -> str:
    """What a hello's ``job`` says: the group's identity (at most 128 bytes)."""
    return f"tabcohort-pg/{PG_VERSION} world={cfg.world} topology={cfg.topology} group={cfg.group}"


class RtcGroupBus:
    """A group's links over WebRTC data channels (see the module docstring).

    Args:
        cfg: the validated configuration (``server``, ``room``, ``token``,
            ``rtc_host_addresses``, ``ice_servers``).

    Attributes:
        mesh: the :class:`~tabcohort.bus.mesh.MeshBus` underneath (bus ids, paths, bytes).
        id_of: bus id of each other rank, once known.
        on_message, on_peer_lost: as on :class:`~tabcohort.pg.tcp.TcpBus`.
    """

    def __init__(self, cfg: PGConfig) -> None:
        from ..bus.aio import mesh_bus, ws_url

        self.cfg = cfg
        self.rank = cfg.rank
        self.tag = group_tag(cfg)
        self.mesh = mesh_bus(ws_url(cfg.server, cfg.room), token=cfg.token, ice_servers=list(cfg.ice_servers),
                             host_addresses=None if cfg.rtc_host_addresses is None else list(cfg.rtc_host_addresses),
                             connect_timeout_s=CHANNEL_OPEN_TIMEOUT_S, idle_timeout_s=None,
                             limits=WireLimits(max_frame_bytes=(1 << 30) + 4096, max_vector_len=1 << 28,
                                               max_incomplete_bytes=1 << 31),
                             on_control=self._on_control, on_fallback=self._on_fallback)
        self.mesh.on_message = self._on_mesh_message
        self.on_message: Callable[[dict], None] | None = None
        self.on_peer_lost: Callable[[int, str], None] | None = None
        self.id_of: dict[int, int] = {}
        self.rank_of: dict[int, int] = {}
        self.acked: set[int] = set()
        self.foreign: dict[int, str] = {}
        self.setup_error: str | None = None
        self.ready = False
        self.closed = False
        self._writers: dict[str, FrameWriter] = {}
        self._changed: asyncio.Event | None = None
        self._clash_with: int | None = None  # the bus id of a second claimant of a rank

    # -- bring-up --------------------------------------------------------------------------
    async def start(self, deadline: float) -> None:
        """Join the room, exchange hellos and wait until every rank's link is up (or on the relay).

        Args:
            deadline: loop time by which bring-up must be done.

        Raises:
            GroupSetupError: the server refused or did not answer, another process claims a rank
                of this group, a rank left during bring-up, or not every rank was ready by the
                deadline (the message names the missing ranks and the links' states).
        """
        from ..bus.room import LinkFailed

        loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        try:
            await self.mesh.connect(max(0.1, deadline - loop.time()))
        except LinkFailed as e:
            raise GroupSetupError(f"rank {self.rank}: cannot join room {self.cfg.room!r} at {self.cfg.server}: {e}") \
                from None
        for bus_id in sorted(self.mesh.peers):
            self._hello(bus_id)
        while True:
            if self.setup_error is not None:
                if self._clash_with is not None:
                    # the claimant may not have heard this rank's hello yet (it can be queued on a
                    # channel still opening, or not out of the SCTP stack when the process exits):
                    # tell it, and wait (bounded) for the hello to be acknowledged before leaving,
                    # else it would wait out its whole bound ("ranks never heard from")
                    self._hello(self._clash_with)
                    await self.flush(min(CLASH_FLUSH_S, max(0.0, deadline - loop.time())))
                raise GroupSetupError(self.setup_error)
            if self._complete():
                break
            left = deadline - loop.time()
            if left <= 0:
                raise GroupSetupError(f"rank {self.rank}: group not ready within {self.cfg.connect_timeout_s:g} s "
                                      f"(PG_CONNECT_TIMEOUT_S) in room {self.cfg.room!r} at {self.cfg.server}: "
                                      + self._missing_text())
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, HELLO_RESEND_S))
            except asyncio.TimeoutError:
                links = self.mesh.paths()
                for bus_id in list(self.mesh.peers):
                    if bus_id not in self.acked and links.get(bus_id) != "connecting":
                        self._hello(bus_id)
        self.ready = True
        relayed = {r: self.mesh.path(i).why for r, i in self.id_of.items() if self.mesh.paths().get(i) == "relay"}
        if relayed:
            log.warning("rank %d: links to rank(s) %s use the server relay: %s", self.rank, sorted(relayed), relayed)

    def _complete(self) -> bool:
        if len(self.id_of) != self.cfg.world - 1:
            return False
        links = self.mesh.paths()
        return all(i in self.acked and links.get(i) in ("rtc", "relay") for i in self.id_of.values())

    def _missing_text(self) -> str:
        links = self.mesh.paths()
        missing = sorted(set(range(self.cfg.world)) - set(self.id_of) - {self.rank})
        state = {r: links.get(i, "gone") + ("" if i in self.acked else ", no ack")
                 for r, i in sorted(self.id_of.items())}
        extra = f"; room peers of other groups: {self.foreign}" if self.foreign else ""
        return f"ranks never heard from: {missing}; links of known ranks: {state}{extra}"

    def _hello(self, bus_id: int) -> None:
        self.mesh.post({"t": "hello", "version": PG_VERSION, "job": self.tag, "batch": self.rank,
                        "ready": bus_id in self.rank_of, "running": False, "step": 0, "model": "",
                        "backend": "rtc", "to": bus_id})

    def _on_hello(self, msg: dict) -> None:
        src = msg["from"]
        if msg["job"] != self.tag:
            self.foreign[src] = msg["job"]
            return
        r = msg["batch"]
        if r == self.rank or r >= self.cfg.world or self.id_of.get(r, src) != src:
            if self.setup_error is None and not self.ready:  # once up, a late claimant is ignored
                self._clash_with = src
                who = "this rank" if r == self.rank else f"bus id {self.id_of.get(r)}"
                self.setup_error = (f"rank {self.rank}: two processes claim rank {r} of group {self.tag!r} in room "
                                    f"{self.cfg.room!r} (bus ids {src} and {who}); give each process its own RANK")
        else:
            self.id_of[r], self.rank_of[src] = src, r
            if msg["ready"]:
                self.acked.add(src)
            else:
                self._hello(src)
        if self._changed is not None:
            self._changed.set()

    # -- inbound ---------------------------------------------------------------------------
    def _on_mesh_message(self, msg: dict) -> None:
        if msg["t"] == "hello" and msg["job"].startswith("tabcohort-pg/"):
            self._on_hello(msg)
            return
        r = self.rank_of.get(msg["from"])
        if r is None or self.closed:  # a known rank's message may precede this rank's readiness: keep it
            return
        msg["from"] = r
        if self.on_message is not None:
            self.on_message(msg)

    def _on_control(self, obj: dict) -> None:
        t = obj.get("type")
        if t == "peer":
            k = obj.get("id")
            if obj.get("up"):
                if isinstance(k, int) and not self.ready:
                    self._hello(k)
            elif k in self.rank_of:
                r = self.rank_of[k]
                if not self.ready:
                    self.setup_error = self.setup_error or \
                        (f"rank {self.rank}: rank {r} left room {self.cfg.room!r} during bring-up (did it give up "
                         f"waiting?); " + self._missing_text())
                elif self.on_peer_lost is not None and not self.closed:
                    self.on_peer_lost(r, "its connection to the server closed (process exited or network lost)")
            if self._changed is not None:
                self._changed.set()

    def _on_fallback(self, peer: int, was: PathState, why: str) -> None:
        """The mesh moved a pair to the relay. Before bring-up ends that is only a slower path;
        after, chunks queued or in flight on the channel are gone, so the peer is lost to this
        rank's collectives (a peer that said goodbye first is not reported by the group)."""
        r = self.rank_of.get(peer)
        if self.ready and was is PathState.DIRECT and r is not None and not self.closed and self.on_peer_lost is not None:
            self.on_peer_lost(r, f"its data channel failed ({why}); data in flight on it is lost")

    # -- the bus contract, by rank ---------------------------------------------------------
    def writer_for(self, precision: str | None) -> FrameWriter:
        """A frame writer at ``precision`` with this rank's bus id as sender."""
        p = precision or "f32"
        w = self._writers.get(p)
        if w is None:
            w = self._writers[p] = FrameWriter(self.mesh.id, precision=p)
        return w

    def post(self, msg: dict, *, precision: str | None = None) -> None:
        """Send ``msg`` to ``msg["to"]`` (a rank) or to every other rank of the group."""
        if self.closed:
            return
        to = msg.get("to")
        if to is not None:
            targets = [self.id_of[to]] if to in self.id_of else []
        else:
            targets = list(self.id_of.values())
        mesh, w = self.mesh, self.writer_for(precision)
        paths = mesh.paths()
        if to is None and set(paths) == set(targets) and all(paths[i] == "rtc" for i in targets):
            mesh.post({k: v for k, v in msg.items() if k != "to"}, writer=w)  # encoded once for every channel
        else:  # addressed (the relay forwards a broadcast to every room peer)
            for i in targets:
                mesh.post(dict(msg, to=i), writer=w)

    def bytes(self) -> dict[int, LinkBytes]:
        """Chunk bytes sent/received per rank."""
        b = self.mesh.bytes()
        return {r: b[i] for r, i in self.id_of.items() if i in b}

    def total_bytes(self) -> int:
        return self.mesh.total_bytes()

    def transport_bytes(self) -> dict[str, int]:
        """Bytes carried by data channels (``rtc``) and by the server relay (``relay``)."""
        return self.mesh.transport_bytes()

    def links(self) -> dict[int, str]:
        """Each other rank's path: ``rtc``, ``relay`` or ``connecting`` (``gone``: left the room)."""
        p = self.mesh.paths()
        return {r: p.get(i, "gone") for r, i in sorted(self.id_of.items())}

    async def flush(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until everything posted is acknowledged by its receiver."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while not self.mesh.flushed() and loop.time() < end:
            await asyncio.sleep(0.01)  # aiortc exposes no event for SCTP acknowledgements

    async def aclose(self) -> None:
        """Leave the room and close every peer connection."""
        self.closed = True
        await self.mesh.aclose()
