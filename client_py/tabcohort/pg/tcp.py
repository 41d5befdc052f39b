"""TcpBus: the direct native transport (asyncio streams, no browser, no server).

Each link is one TCP connection carrying the project's chunks (:mod:`tabcohort.wire`), each
prefixed by its length (``u32`` little-endian). The bus implements the bus contract
(PROTOCOL.md, "Bus contract"; :class:`tabcohort.bus.Bus`) and passes the conformance battery
(``tests/conformance/tcp_harness.py``). ``bytes()`` counts what TCP carries: chunk bytes plus the
4-byte length prefix of each chunk.

Bring-up (:func:`accept_links`, :func:`dial`) exchanges one ``hello`` frame each way: the
dialler's chunk header names its rank, its ``job`` names the group (world size, topology); the
listener answers with its own. A mismatch is a :class:`~tabcohort.pg.errors.GroupSetupError`.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any, Callable

from ..bus.base import LinkBytes
from ..wire import FrameReader, FrameWriter, WireLimits

LEN = struct.Struct("<I")
#: TCP has no message size limit; chunks this large keep per-chunk overhead negligible.
TCP_MAX_MESSAGE_BYTES = 1 << 20
PG_VERSION = 1
#: StreamReader buffer limit: large, so a 1 MiB chunk is read without pausing the socket per 128 KiB.
STREAM_LIMIT = 2 << 20


class _Link:
    __slots__ = ("peer", "reader", "writer", "sent", "received", "task", "alive")

    def __init__(self, peer: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.peer, self.reader, self.writer = peer, reader, writer
        self.sent = self.received = 0
        self.task: asyncio.Task | None = None
        self.alive = True


class TcpBus:
    """One rank's end of its TCP links (see module docstring).

    Args:
        rank: this rank's id (uint32); the ``sender`` of every chunk.
        precision: default wire precision (``f32``, ``f16``, ``bf16``, ``int8``).
        max_message_bytes: chunk size limit, 4-byte prefix excluded.
        high_water_bytes: per-link queued bytes at which ``pressure() == 1``.
        limits: reader bounds (default: room for vectors up to 2**28 elements).

    Attributes:
        on_message: called with every decoded message (set by the owner).
        on_peer_lost: called with ``(peer, detail)`` once per link that closes without
            :meth:`close` on this side.
    """

    def __init__(self, rank: int, *, precision: str = "f32", max_message_bytes: int = TCP_MAX_MESSAGE_BYTES,
                 high_water_bytes: int = 1 << 20, limits: WireLimits | None = None) -> None:
        self.id = rank
        self.precision = precision
        self.max_message_bytes = max_message_bytes
        self.high_water_bytes = high_water_bytes
        self.limits = limits or WireLimits(max_frame_bytes=(1 << 30) + 4096, max_vector_len=1 << 28,
                                           max_incomplete_bytes=1 << 31)
        self.writer = FrameWriter(rank, precision=precision, max_message_bytes=max_message_bytes)
        self._writers = {precision: self.writer}
        self.reader = FrameReader(self.limits)
        self.on_message: Callable[[dict], None] | None = None
        self.on_peer_lost: Callable[[int, str], None] | None = None
        self.links: dict[int, _Link] = {}
        self.closed = False
        self._gate = asyncio.Event()
        self._gate.set()
        self._drops: dict[str, int] = {}

    # -- links -------------------------------------------------------------------------
    def add_link(self, peer: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Adopt a handshaken connection to ``peer`` and start reading it (task held here)."""
        link = _Link(peer, reader, writer)
        self.links[peer] = link
        link.task = asyncio.get_running_loop().create_task(self._read_loop(link), name=f"tcpbus-{self.id}<-{peer}")

    async def _read_loop(self, link: _Link) -> None:
        loop = asyncio.get_running_loop()
        detail = "connection closed"
        try:
            while True:
                hdr = await link.reader.readexactly(4)
                (n,) = LEN.unpack(hdr)
                if n > self.max_message_bytes_in():
                    self._drop("absurd_size")
                    detail = f"chunk of {n} bytes exceeds the limit"
                    break
                chunk = await link.reader.readexactly(n)
                if not self._gate.is_set():
                    await self._gate.wait()
                if self.closed:
                    return
                link.received += n + 4
                for msg in self.reader.feed(chunk, now_ms=loop.time() * 1000.0):
                    if msg["from"] != link.peer:
                        self._drop("spoofed_sender")
                        continue
                    if self.on_message is not None:
                        self.on_message(msg)
        except asyncio.IncompleteReadError:
            detail = "connection closed (EOF)"
        except (ConnectionError, OSError) as e:
            detail = f"connection error: {e!r}"
        if link.alive and not self.closed:
            link.alive = False
            link.writer.close()
            if self.on_peer_lost is not None:
                self.on_peer_lost(link.peer, detail)

    def max_message_bytes_in(self) -> int:
        """Largest chunk accepted from a peer (any peer's chunk size up to the frame limit)."""
        return self.limits.max_frame_bytes + 64

    def _drop(self, reason: str) -> None:
        self._drops[reason] = self._drops.get(reason, 0) + 1

    # -- the bus contract --------------------------------------------------------------
    def writer_for(self, precision: str | None) -> FrameWriter:
        """The frame writer at ``precision`` (``None`` = the bus's own)."""
        if precision is None:
            return self.writer
        w = self._writers.get(precision)
        if w is None:
            w = self._writers[precision] = FrameWriter(self.id, precision=precision,
                                                       max_message_bytes=self.max_message_bytes)
        return w

    def post(self, msg: dict, *, precision: str | None = None) -> None:
        """Send ``msg`` to every linked peer, or only to ``msg["to"]``.

        The chunks of one frame are written to the link back to back, so frames never
        interleave on a link. A dead or unknown target is skipped (counted ``no_route``).

        Raises:
            LocalProtocolError: the message cannot be encoded.
        """
        if self.closed:
            return
        chunks = self.writer_for(precision).write(msg)
        to = msg.get("to")
        targets = [self.links.get(to)] if to is not None else list(self.links.values())
        data = None
        for link in targets:
            if link is None or not link.alive:
                self._drop("no_route")
                continue
            if data is None:
                parts = []
                for c in chunks:
                    parts.append(LEN.pack(len(c)))
                    parts.append(c)
                data = b"".join(parts)
            link.writer.write(data)
            link.sent += len(data)

    def bytes(self) -> dict[int, LinkBytes]:
        return {p: LinkBytes(lk.sent, lk.received) for p, lk in self.links.items()}

    def total_bytes(self) -> int:
        return sum(lk.sent + lk.received for lk in self.links.values())

    def queued_bytes(self, peer: int) -> int:
        """Bytes written to the link's transport but not yet handed to the kernel."""
        lk = self.links.get(peer)
        if lk is None or lk.writer.transport.is_closing():
            return 0
        return lk.writer.transport.get_write_buffer_size()

    def pressure(self) -> float:
        return max((self.queued_bytes(p) for p in self.links), default=0) / self.high_water_bytes

    def quantize(self, params: Any) -> Any:
        return self.writer.quantize(params)

    def drops(self) -> dict[str, int]:
        out = dict(self.reader.drops)
        for k, v in self._drops.items():
            out[k] = out.get(k, 0) + v
        return out

    def stall(self, stalled: bool) -> None:
        """Stop (True) or resume (False) taking chunks off every link (a test knob)."""
        if stalled:
            self._gate.clear()
        else:
            self._gate.set()
        for lk in self.links.values():
            if lk.alive and not lk.writer.transport.is_closing():
                if stalled:
                    lk.writer.transport.pause_reading()
                else:
                    lk.writer.transport.resume_reading()

    async def flush(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s`` per link) until every link's queued bytes reach the kernel."""
        for lk in self.links.values():
            try:
                await asyncio.wait_for(lk.writer.drain(), timeout_s)
            except (Exception, asyncio.TimeoutError):  # noqa: BLE001 - closing anyway
                pass

    def close(self) -> None:
        """Stop delivery both ways and close every link (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._gate.set()
        for lk in self.links.values():
            lk.alive = False
            lk.writer.close()
            if lk.task is not None:
                lk.task.cancel()

    async def aclose(self) -> None:
        """:meth:`close`, then wait for the reader tasks and sockets to finish."""
        self.close()
        tasks = [lk.task for lk in self.links.values() if lk.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        for lk in self.links.values():
            try:
                await asyncio.wait_for(lk.writer.wait_closed(), 5.0)
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - closing anyway
                pass


# -- bring-up -------------------------------------------------------------------------
def _group_tag(world: int, topology: str) -> str:
    return f"tabcohort-pg/{PG_VERSION} world={world} topology={topology}"


def _hello(rank: int, world: int, topology: str) -> bytes:
    w = FrameWriter(rank)
    (c,) = w.write({"t": "hello", "version": PG_VERSION, "job": _group_tag(world, topology), "batch": 0,
                    "ready": True, "running": False, "step": 0, "model": "", "backend": "tcp"})
    return LEN.pack(len(c)) + c


async def _read_hello(reader: asyncio.StreamReader) -> dict | None:
    (n,) = LEN.unpack(await reader.readexactly(4))
    if n > 4096:
        return None
    msgs = FrameReader().feed(await reader.readexactly(n), now_ms=0.0)
    if len(msgs) != 1 or msgs[0]["t"] != "hello":
        return None
    return msgs[0]


class Listener:
    """Accepts inbound links for one bus; each must say hello for this group.

    Args:
        bus: the bus adopting accepted links.
        world, topology: the group; a dialler from another group is refused.
        expect: ranks allowed to dial in.
    """

    def __init__(self, bus: TcpBus, *, world: int, topology: str, expect: set[int]) -> None:
        self.bus, self.world, self.topology = bus, world, topology
        self.expect = set(expect)
        self.server: asyncio.AbstractServer | None = None
        self.arrived = asyncio.Event()
        self.errors: list[str] = []
        if not self.expect:
            self.arrived.set()

    async def start(self, host: str, port: int) -> int:
        """Bind and listen; returns the bound port (``port=0`` picks a free one)."""
        self.server = await asyncio.start_server(self._on_conn, host or None, port, reuse_address=True,
                                                 limit=STREAM_LIMIT)
        # an unspecified host binds one socket per address family, each on its own free port:
        # report the IPv4 one (what discovery advertises)
        socks = sorted(self.server.sockets, key=lambda k: k.family != socket.AF_INET)
        return socks[0].getsockname()[1]

    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            h = await asyncio.wait_for(_read_hello(reader), 10.0)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
            writer.close()
            return
        tag = _group_tag(self.world, self.topology)
        if h is None or h["job"] != tag or h["from"] not in self.expect or h["from"] in self.bus.links:
            self.errors.append(f"refused a dialler: {None if h is None else (h['from'], h['job'])!r}, "
                               f"expected one of ranks {sorted(self.expect - set(self.bus.links))} in {tag!r}")
            writer.close()
            return
        writer.write(_hello(self.bus.id, self.world, self.topology))
        self.bus.add_link(h["from"], reader, writer)
        if self.expect <= set(self.bus.links):
            self.arrived.set()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def dial(bus: TcpBus, peer: int, host: str, port: int, *, world: int, topology: str,
               deadline: float) -> None:
    """Connect to ``peer`` at ``host:port`` (retrying refusals until ``deadline``, loop time),
    exchange hellos and adopt the link.

    Raises:
        GroupSetupError: no answer by the deadline, or the peer is not ``peer`` of this group.
    """
    from .errors import GroupSetupError

    loop = asyncio.get_running_loop()
    delay, last = 0.02, ""
    while True:
        left = deadline - loop.time()
        if left <= 0:
            raise GroupSetupError(f"rank {bus.id}: could not reach rank {peer} at {host}:{port} ({last})")
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=STREAM_LIMIT), left)
            writer.write(_hello(bus.id, world, topology))
            h = await asyncio.wait_for(_read_hello(reader), max(0.1, deadline - loop.time()))
        except (ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            last = repr(e)
            await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))  # connect backoff
            delay = min(delay * 2, 0.5)
            continue
        if h is None or h["from"] != peer or h["job"] != _group_tag(world, topology):
            writer.close()
            raise GroupSetupError(f"rank {bus.id}: {host}:{port} answered as "
                                  f"{None if h is None else (h['from'], h['job'])!r}, expected rank {peer} "
                                  f"in {_group_tag(world, topology)!r}")
        bus.add_link(peer, reader, writer)
        return
