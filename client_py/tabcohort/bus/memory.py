"""In-memory bus: ranks in one process exchange encoded chunks, never Python objects.

For tests and simulations (docs/INTERFACES.md, "Bus"). Every message is encoded by the sender's
:class:`~tabcohort.wire.FrameWriter` and decoded by the receiver's
:class:`~tabcohort.wire.FrameReader`, so wire precision, chunking and byte counts are real.
Delivery always goes through the scheduler (``call_later``, zero delay included): a ``post``
never re-enters a receiver synchronously.

Fault knobs live on :class:`MemoryNetwork` (per directed link: delay, jitter, loss,
duplication, reordering; partition/heal; stall). Each decision is drawn per frame and per link
from one ``random.Random(seed)``, so a run is reproducible.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, NamedTuple

from ..errors import ConfigError
from ..sched import Scheduler
from ..wire import DEFAULT_MAX_MESSAGE_BYTES, FrameReader, FrameWriter, WireLimits
from ..wire.codecs import DEFAULT_INT8_BLOCK
from .base import ByteCounts, LinkBytes, merge_counts

DEFAULT_HIGH_WATER_BYTES = 1 << 20


class Delivery(NamedTuple):
    """One message delivered to one rank, as recorded in :attr:`MemoryNetwork.log`."""

    time_ms: float
    sender: int
    recipient: int
    msg: dict


@dataclass(frozen=True)
class LinkKnobs:
    """Faults on one directed link (all off by default).

    Attributes:
        delay_ms: one-way latency, milliseconds.
        jitter_ms: extra latency drawn uniformly from [0, jitter_ms] per frame (reorders).
        loss: probability a frame is lost (all its chunks).
        duplicate: probability a frame is delivered twice.
        reorder: probability a frame is held back by ``2 * delay_ms + jitter_ms + 1`` ms, so
            frames sent after it overtake it.
        bandwidth_bytes_per_s: the link's capacity, encoded bytes per second (0: unlimited).
            Frames are serialised onto it in order: a frame starts when the one before it has
            left, takes ``size / bandwidth`` seconds to leave, then ``delay_ms`` (and jitter)
            to arrive; bytes not yet arrived count in the sender's ``pressure()``.
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    bandwidth_bytes_per_s: float = 0.0


class _Link:
    __slots__ = ("knobs", "queued_bytes", "held", "free_at_ms")

    def __init__(self, knobs: LinkKnobs) -> None:
        self.knobs = knobs
        self.queued_bytes = 0
        self.held: list[_Entry] = []
        self.free_at_ms = -math.inf     # when the link has sent everything handed to it


class _Entry:
    __slots__ = ("src", "dst", "chunks", "size")

    def __init__(self, src: "MemoryBus", dst: "MemoryBus", chunks: list[bytes], size: int) -> None:
        self.src, self.dst, self.chunks, self.size = src, dst, chunks, size


class MemoryBus:
    """One rank's end of a :class:`MemoryNetwork` (the bus contract, PROTOCOL.md).

    Made by :meth:`MemoryNetwork.attach`; see :class:`tabcohort.bus.Bus` for the methods.
    """

    def __init__(self, network: "MemoryNetwork", rank_id: int) -> None:
        self.id = rank_id
        self.on_message: Callable[[dict], None] | None = None
        self.closed = False
        self._net = network
        self.writer = FrameWriter(rank_id, precision=network.precision,
                                  max_message_bytes=network.max_message_bytes,
                                  int8_block=network.int8_block, use_numpy=network.use_numpy)
        self.reader = FrameReader(network.limits, use_numpy=network.use_numpy)
        self.counts = ByteCounts()
        self._drops: dict[str, int] = {}

    def post(self, msg: dict) -> None:
        """Encode ``msg`` and queue it to every other live rank, or to ``msg["to"]`` only.

        A message to a rank that is not attached (or is closed, or is this rank) is dropped and
        counted ``no_route``. After :meth:`close`, ``post`` does nothing.

        Raises:
            LocalProtocolError: the message cannot be encoded.
        """
        if self.closed:
            return
        self._net._post(self, msg)

    def bytes(self) -> dict[int, LinkBytes]:
        return self.counts.links()

    def total_bytes(self) -> int:
        return self.counts.total()

    def pressure(self) -> float:
        return self._net._pressure(self)

    def quantize(self, params: Any) -> Any:
        return self.writer.quantize(params)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.on_message = None
            self._net._closed(self)

    def drops(self) -> dict[str, int]:
        return merge_counts(self.reader.drops, self._drops)

    def _count(self, reason: str) -> None:
        self._drops[reason] = self._drops.get(reason, 0) + 1


class MemoryNetwork:
    """A simulated network of :class:`MemoryBus` ends over one scheduler.

    Args:
        scheduler: clock and delayed callbacks (:class:`tabcohort.sched.SimScheduler` in
            simulations, :class:`tabcohort.sched.AsyncioScheduler` under asyncio).
        seed: seeds loss, duplication, jitter and reordering.
        precision: wire precision of every bus (``f32``, ``f16``, ``bf16``, ``int8``).
        max_message_bytes: chunk size limit, header included.
        high_water_bytes: per-link queued bytes at which ``pressure()`` reaches 1.
        int8_block: int8 block size.
        limits: reader bounds of every bus.
        use_numpy: ``None`` = numpy when importable.
        log: keep :attr:`log` (decoded by the network's own readers, independently of the buses).

    Attributes:
        log: every delivery, ``Delivery(time_ms, sender, recipient, msg)``, in delivery order.
        drops: network-level drops by reason: ``loss``, ``partition``, ``closed``, ``no_route``,
            ``cut`` (see :attr:`cut_at_ms`).
        cut_at_ms: scheduler time from which nothing is delivered: a frame posted or arriving
            then is dropped unread (``cut``). A run bounded in time sets it: a cohort whose
            frames come faster than they are handled (every rank beats to every other, about
            n^2 deliveries per beat period: README "Scaling limits") kept the event loop's
            queue full for minutes past the bound, and nothing else ran to see that the time
            was up.

    Raises:
        ConfigError: a bad precision, size or block.
    """

    def __init__(self, scheduler: Scheduler, *, seed: int = 0, precision: str = "f32",
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 high_water_bytes: int = DEFAULT_HIGH_WATER_BYTES, int8_block: int = DEFAULT_INT8_BLOCK,
                 limits: WireLimits | None = None, use_numpy: bool | None = None, log: bool = True) -> None:
        if not isinstance(high_water_bytes, int) or high_water_bytes < 1:
            raise ConfigError("high_water_bytes", high_water_bytes, "must be a positive int")
        self.scheduler = scheduler
        self.rng = random.Random(seed)
        self.precision = precision
        self.max_message_bytes = max_message_bytes
        self.high_water_bytes = high_water_bytes
        self.int8_block = int8_block
        self.limits = limits or WireLimits()
        self.use_numpy = use_numpy
        FrameWriter(0, precision=precision, max_message_bytes=max_message_bytes,
                    int8_block=int8_block, use_numpy=use_numpy)  # validate the config now
        self.buses: dict[int, MemoryBus] = {}
        self.log: list[Delivery] = []
        self.log_enabled = log
        self.drops: dict[str, int] = {}
        self._log_readers: dict[int, FrameReader] = {}
        self._default = LinkKnobs()
        self._links: dict[tuple[int, int], _Link] = {}
        self._groups: dict[int, int] | None = None
        self._stalled: set[int] = set()
        self._in_flight = 0
        self.cut_at_ms = math.inf

    # topology ---------------------------------------------------------------
    def attach(self, rank_id: int) -> MemoryBus:
        """A new bus for ``rank_id`` (uint32). A closed rank's id may be attached again.

        Raises:
            ConfigError: ``rank_id`` is not a uint32 or is attached and open.
        """
        if isinstance(rank_id, bool) or not isinstance(rank_id, int) or not 0 <= rank_id <= 0xFFFFFFFF:
            raise ConfigError("rank_id", rank_id, "must be a uint32")
        old = self.buses.get(rank_id)
        if old is not None and not old.closed:
            raise ConfigError("rank_id", rank_id, "is already attached")
        bus = self.buses[rank_id] = MemoryBus(self, rank_id)
        self._log_readers[rank_id] = FrameReader(self.limits, use_numpy=self.use_numpy)
        return bus

    def set_link(self, a: int, b: int, *, symmetric: bool = True, **knobs: float) -> None:
        """Set fault knobs (:class:`LinkKnobs` field names) on the link a -> b (and b -> a)."""
        for key in ((a, b), (b, a)) if symmetric else ((a, b),):
            link = self._link(*key)
            link.knobs = replace(link.knobs, **knobs)

    def set_default_link(self, **knobs: float) -> None:
        """Set fault knobs on every link not configured with :meth:`set_link`."""
        self._default = replace(self._default, **knobs)
        for link in self._links.values():
            link.knobs = replace(link.knobs, **knobs)

    def partition(self, groups: Iterable[Iterable[int]]) -> None:
        """Split the network: ranks talk only within their group. Ranks in no group form one
        more group together. Frames in flight across groups are lost on arrival."""
        self._groups = {r: i for i, g in enumerate(groups) for r in g}

    def heal(self) -> None:
        """End any partition."""
        self._groups = None

    def stall(self, rank_id: int, stalled: bool) -> None:
        """Hold (True) or release (False) deliveries to ``rank_id``. Held frames stay queued on
        their senders' links (they count toward the senders' ``pressure()``)."""
        if stalled:
            self._stalled.add(rank_id)
            return
        self._stalled.discard(rank_id)
        for (src, dst), link in self._links.items():
            if dst == rank_id and link.held:
                held, link.held = link.held, []
                for e in held:
                    self._in_flight += 1
                    self.scheduler.call_later(0, self._arrive, e)

    def pending(self) -> int:
        """Frames scheduled for arrival (not counting frames held by a stall)."""
        return self._in_flight

    # internals ------------------------------------------------------------
    def _link(self, a: int, b: int) -> _Link:
        link = self._links.get((a, b))
        if link is None:
            link = self._links[(a, b)] = _Link(self._default)
        return link

    def _connected(self, a: int, b: int) -> bool:
        g = self._groups
        return g is None or g.get(a, -1) == g.get(b, -1)

    def _drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1

    def _post(self, src: MemoryBus, msg: dict) -> None:
        if self.scheduler.now_ms() >= self.cut_at_ms:
            self._drop("cut")
            return
        chunks = src.writer.write(msg)
        size = sum(map(len, chunks))
        to = msg.get("to")
        if to is None:
            dsts = [b for r, b in self.buses.items() if r != src.id and not b.closed]
        else:
            b = self.buses.get(to)
            if b is None or b.closed or to == src.id:
                self._drop("no_route")
                src._count("no_route")
                return
            dsts = [b]
        rng = self.rng
        for dst in dsts:
            src.counts.add_sent((dst.id,), size)
            if not self._connected(src.id, dst.id):
                self._drop("partition")
                continue
            link = self._link(src.id, dst.id)
            k = link.knobs
            if k.loss and rng.random() < k.loss:
                self._drop("loss")
                continue
            copies = 2 if k.duplicate and rng.random() < k.duplicate else 1
            for _ in range(copies):
                delay = k.delay_ms
                if k.bandwidth_bytes_per_s > 0:
                    # serialised onto the link after what it still has to send
                    now = self.scheduler.now_ms()
                    start = max(now, link.free_at_ms)
                    link.free_at_ms = start + 1000.0 * size / k.bandwidth_bytes_per_s
                    delay += link.free_at_ms - now
                if k.jitter_ms:
                    delay += rng.uniform(0.0, k.jitter_ms)
                if k.reorder and rng.random() < k.reorder:
                    delay += 2 * k.delay_ms + k.jitter_ms + 1.0
                link.queued_bytes += size
                self._in_flight += 1
                self.scheduler.call_later(delay, self._arrive, _Entry(src, dst, chunks, size))

    def _arrive(self, e: _Entry) -> None:
        self._in_flight -= 1
        link = self._link(e.src.id, e.dst.id)
        if e.dst.id in self._stalled and not e.dst.closed and self.buses.get(e.dst.id) is e.dst:
            link.held.append(e)
            return
        link.queued_bytes -= e.size
        now = self.scheduler.now_ms()
        if now >= self.cut_at_ms:
            self._drop("cut")
            return
        if e.src.closed or e.dst.closed:
            self._drop("closed")
            return
        if not self._connected(e.src.id, e.dst.id):
            self._drop("partition")
            return
        dst, src_id = e.dst, e.src.id
        log_reader = self._log_readers[dst.id] if self.log_enabled else None
        for chunk in e.chunks:
            dst.counts.add_received(src_id, len(chunk))
            msgs = dst.reader.feed(chunk, now_ms=now)
            if log_reader is not None:
                for m in log_reader.feed(chunk, now_ms=now):
                    self.log.append(Delivery(now, src_id, dst.id, m))
            for m in msgs:
                cb = dst.on_message
                if cb is not None and not dst.closed:
                    cb(m)

    def _pressure(self, bus: MemoryBus) -> float:
        worst = 0
        for (src, _dst), link in self._links.items():
            if src == bus.id and link.queued_bytes > worst:
                worst = link.queued_bytes
        return worst / self.high_water_bytes

    def _closed(self, bus: MemoryBus) -> None:
        for (src, dst), link in self._links.items():
            if (src == bus.id or dst == bus.id) and link.held:
                for e in link.held:
                    link.queued_bytes -= e.size
                    self._drop("closed")
                link.held = []
