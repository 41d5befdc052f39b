"""ProcessGroup: classic collectives over a fixed world of ranks (README, "Fixed-world process group").

Semantics shared by every collective:

- **Order.** Every rank must call the same collectives in the same order. Each call takes the
  next sequence number; every message carries it and the call's signature (collective, length,
  op, root, wire precision). A rank that receives a different signature for the same sequence
  number raises :class:`~tabcohort.pg.errors.CollectiveMismatchError`, and so does every other
  rank in that same call (the deciding rank(s) see every signature; see below).
- **Returned, not in place.** Each collective returns a new array of the input's type and shape
  (numpy float32, or ``array('f')``); the input is never modified.
- **Bit-identical results.** A reduction is computed once per element, by one rank, in rank
  order ``0 .. world-1`` in float32, then sent to everyone: star: the hub (rank 0) reduces the
  whole vector; mesh: rank j reduces shard j (contiguous, 256-element aligned; reduce-scatter),
  then every owner sends its shard to every rank (all-gather).
- **Wire precision** (``precision="f16"|"bf16"|"int8"``) applies to what travels: each rank's
  contribution is quantized (the owner quantizes its own the same way), the reduction runs on
  the quantized values in float32, and the reduced result is quantized again before it is
  sent; the owner keeps that quantized result too. So the result on every rank is
  ``Q(reduce(Q(x_0), ..., Q(x_{w-1})))`` with ``Q`` = ``FrameWriter(precision=p).quantize``
  (per shard in mesh; equal to the whole-vector ``Q`` because shards are int8-block aligned,
  except that an f16/bf16 overflow falls back to f32 per shard rather than per vector).
- **Failures break the group.** A lost peer (TCP: its socket closed, noticed at once; WebRTC:
  the server says its connection closed, or its data channel failed), a timeout
  (``timeout_s``, default 10 s), a mismatch or a memory bound raises on this rank and is sent
  to the others as an abort, and every later call raises the same error.
"""

from __future__ import annotations

import asyncio
from typing import Any

from . import ops
from .config import PGConfig
from .errors import (CollectiveMismatchError, CollectiveTimeoutError, GroupSetupError, MemoryBoundError,
                     PeerLostError, PGError)
from .tcp import Listener, TcpBus, dial

ABORT_MISMATCH, ABORT_LOST, ABORT_TIMEOUT, ABORT_MEMORY, BYE = 1, 2, 3, 4, 5
_ABORT_TAG = "tabcohort-pg-abort"


class ProcessGroup:
    """A connected fixed-world group (asyncio API). Make one with
    :func:`tabcohort.pg.init_process_group`.

    Attributes:
        rank: this rank, in [0, world).
        world: the number of ranks.
        topology: ``"mesh"`` or ``"star"``.
        bus: the links: a :class:`~tabcohort.pg.tcp.TcpBus` (TCP), or with a server a
            :class:`~tabcohort.pg.rtc.RtcGroupBus` (WebRTC data channels; its ``links()`` and
            ``transport_bytes()`` say which path carried what).
    """

    def __init__(self, cfg: PGConfig, bus: Any) -> None:
        self.cfg = cfg
        self.rank, self.world, self.topology = cfg.rank, cfg.world, cfg.topology
        self.bus = bus
        self._seq = 0
        self._box: dict[tuple[int, int, int], dict] = {}
        self._waiting: dict[tuple[int, int, int], asyncio.Future] = {}
        self._error: PGError | None = None
        self._left: dict[int, str] = {}
        self._advertiser: Any = None
        self.closed = False
        bus.on_message = self._on_message
        bus.on_peer_lost = self._on_peer_lost

    # -- bring-up --------------------------------------------------------------------------
    @classmethod
    async def connect(cls, cfg: PGConfig) -> "ProcessGroup":
        """Open the links of ``cfg`` and return the group (bounded by ``connect_timeout_s``).

        TCP (no server): mesh: every rank listens (on ``PEERS[rank]``, or with discovery on
        ``PG_LISTEN_HOST:PG_LISTEN_PORT``, advertised); rank i dials every rank below it. Star:
        rank 0 listens; the others dial it (they need no inbound port). The peers' addresses come
        from ``PEERS`` or from discovery (:mod:`tabcohort.pg.discovery`).

        WebRTC (a server is given): every rank joins the server room and gets a data channel
        to every other rank (:mod:`tabcohort.pg.rtc`); ``topology`` then only chooses the
        collective algorithm (star: rank 0 reduces everything).

        Raises:
            GroupSetupError: a peer was not found or did not answer within ``connect_timeout_s``,
                answered for a different group, or another process claims this rank.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.connect_timeout_s
        if cfg.server and cfg.world > 1:  # a world of one needs no links at all
            from .rtc import RtcGroupBus

            rbus = RtcGroupBus(cfg)
            group = cls(cfg, rbus)
            try:
                await rbus.start(deadline)
            except BaseException:
                await rbus.aclose()
                raise
            return group
        bus = TcpBus(cfg.rank)
        group = cls(cfg, bus)
        if cfg.world == 1:
            return group
        if cfg.topology == "mesh":
            expect, targets = set(range(cfg.rank + 1, cfg.world)), list(range(cfg.rank))
        else:
            expect = set(range(1, cfg.world)) if cfg.rank == 0 else set()
            targets = [] if cfg.rank == 0 else [0]
        listener = Listener(bus, world=cfg.world, topology=cfg.topology, expect=expect)
        try:
            port = await listener.start(cfg.listen_host, cfg.listen_port) if cfg.listens else 0
            peers = dict(enumerate(cfg.peers))
            if cfg.discovery != "static":
                from . import discovery

                if cfg.listens:
                    group._advertiser = await discovery.advertise(cfg, port)
                peers = await discovery.find_async(cfg, max(0.0, deadline - loop.time()))
            await asyncio.gather(*(dial(bus, j, *peers[j], world=cfg.world, topology=cfg.topology,
                                        deadline=deadline) for j in targets))
            try:
                await asyncio.wait_for(listener.arrived.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                missing = sorted(expect - set(bus.links))
                raise GroupSetupError(f"rank {cfg.rank}: rank(s) {missing} did not connect within "
                                      f"{cfg.connect_timeout_s:g} s" +
                                      (f" ({'; '.join(listener.errors)})" if listener.errors else "")) from None
        except BaseException:
            listener.close()
            await group._stop_advertising()
            await bus.aclose()
            raise
        listener.close()
        return group

    async def _stop_advertising(self) -> None:
        adv, self._advertiser = self._advertiser, None
        if adv is not None:
            try:
                await adv.stop()
            except Exception:  # noqa: BLE001 - best effort: the record expires anyway
                pass

    # -- incoming --------------------------------------------------------------------------
    def _on_message(self, msg: dict) -> None:
        if msg["t"] == "hello" and msg["job"] == _ABORT_TAG:
            self._on_abort(msg)
            return
        if msg["t"] != "grad":
            return
        _sig, phase = ops.Sig.unpack(msg["samples"])
        key = (msg["step"], msg["from"], phase)
        if msg["step"] < self._seq:
            return  # stale: from a collective this rank already finished or abandoned
        fut = self._waiting.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)
        else:
            self._box[key] = msg

    def _on_abort(self, msg: dict) -> None:
        code, src, text = msg["batch"], msg["from"], msg["model"]
        if code == BYE:
            self._left[src] = "left the group (closed)"
            err = PeerLostError(src, "left the group (closed)")
            for key, fut in list(self._waiting.items()):
                if key[1] == src and not fut.done():
                    fut.set_exception(err)
            return
        if code == ABORT_LOST:
            try:
                lost = int(msg["backend"])
            except ValueError:
                lost = src
            err: PGError = PeerLostError(lost, f"reported by rank {src}: {text}")
        elif code == ABORT_MISMATCH:
            err = CollectiveMismatchError(f"reported by rank {src}: {text}")
        elif code == ABORT_MEMORY:
            err = MemoryBoundError(f"reported by rank {src}: {text}")
        else:
            err = CollectiveTimeoutError(msg["step"], [src], self.cfg.timeout_s)
            err.args = (f"reported by rank {src}: {text}",)
        self._fail(err, notify=False)

    def _on_peer_lost(self, peer: int, detail: str) -> None:
        if peer in self._left or self.closed:
            return
        self._fail(PeerLostError(peer, detail), notify=True)

    def _fail(self, err: PGError, *, notify: bool) -> None:
        if self._error is not None:
            return
        self._error = err
        # (a later call raised the same text and nothing said why: a new-user trial)
        err.add_note("the process group is broken by this error: every later call on it raises it; "
                     "create a new group to go on (tabcohort.pg.errors)")
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(err)
        self._waiting.clear()
        if notify:
            code = {PeerLostError: ABORT_LOST, CollectiveMismatchError: ABORT_MISMATCH,
                    MemoryBoundError: ABORT_MEMORY}.get(type(err), ABORT_TIMEOUT)
            self._post_abort(code, str(err), getattr(err, "rank", self.rank))

    def _post_abort(self, code: int, text: str, about: int) -> None:
        b = text.encode("utf-8")[:256].decode("utf-8", "ignore")
        self.bus.post({"t": "hello", "version": 1, "job": _ABORT_TAG, "batch": code, "ready": False,
                       "running": False, "step": self._seq, "model": b, "backend": str(about)})

    async def _recv(self, seq: int, src: int, phase: int, deadline: float) -> dict:
        key = (seq, src, phase)
        msg = self._box.pop(key, None)
        if msg is not None:
            return msg
        if self._error is not None:
            raise self._error
        if src in self._left:
            raise PeerLostError(src, self._left[src])
        loop = asyncio.get_running_loop()
        fut = self._waiting[key] = loop.create_future()
        try:
            return await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            err = CollectiveTimeoutError(seq, [src], self.cfg.timeout_s)
            self._fail(err, notify=True)
            raise err from None
        finally:
            self._waiting.pop(key, None)

    def _check(self, mine: ops.Sig, msg: dict) -> None:
        theirs, _ = ops.Sig.unpack(msg["samples"])
        if theirs != mine:
            err = CollectiveMismatchError(
                f"collective #{msg['step']}: rank {msg['from']} called {theirs.describe()} but rank "
                f"{self.rank} called {mine.describe()} (collectives must be called in the same order "
                f"with the same lengths and arguments on every rank)")
            self._fail(err, notify=True)
            raise err

    def _send(self, sig: ops.Sig, phase: int, vec: Any, *, to: int | None, weight: float = 0.0) -> None:
        msg = {"t": "grad", "term": 1, "step": self._seq, "loss": weight, "samples": sig.pack(phase), "g": vec}
        if to is not None:
            msg["to"] = to
        self.bus.post(msg, precision=ops.PREC_NAMES[sig.prec])

    def _q(self, vec: Any, prec: str) -> Any:
        if prec == "f32" or len(vec) == 0:
            return vec
        return ops.to_vec(self.bus.writer_for(prec).quantize(vec))

    def _begin(self, sig: ops.Sig, buffered_bytes: int) -> float:
        if self.closed:
            raise PGError("the process group is closed")
        if self._error is not None:
            raise self._error
        if self._left:
            r, why = next(iter(self._left.items()))
            err = PeerLostError(r, why)
            self._fail(err, notify=True)
            raise err
        lim = self.cfg.max_memory_bytes
        if lim is not None and buffered_bytes > lim:
            err = MemoryBoundError(f"MAX_MEMORY_BYTES={lim}: {sig.describe()} would buffer {buffered_bytes} "
                                   f"bytes on rank {self.rank} ({self.topology})")
            self._fail(err, notify=True)
            raise err
        return asyncio.get_running_loop().time() + self.cfg.timeout_s

    def _estimate(self, n: int) -> int:
        if self.topology == "star":
            return 4 * n * (self.world + 1) if self.rank == 0 else 8 * n
        return 4 * (-(-n // self.world)) * (self.world - 1) + 8 * n

    # -- collectives -----------------------------------------------------------------------
    async def all_reduce(self, x: Any, op: str = "sum", *, precision: str = "f32") -> Any:
        """Reduce ``x`` elementwise over all ranks; every rank gets the same bits.

        Args:
            x: float32 data: a numpy ``float32`` array of any shape, or ``array('f')``; the same
                number of elements on every rank.
            op: ``"sum"``, ``"mean"`` (sum / world in float32), ``"min"`` or ``"max"``
                (NaN propagates). Sums run in rank order in float32.
            precision: wire precision of what travels (see the module docstring).

        Returns:
            A new array of ``x``'s type and shape holding the reduced values (``x`` is left
            unchanged), equal bit for bit on every rank.

        Raises:
            ValueError: unknown ``op`` or ``precision`` (local, nothing sent).
            TypeError: ``x`` is not float32 data (local, nothing sent).
            CollectiveMismatchError: another rank called a different collective, length, op or
                precision at this sequence number (raised on every rank).
            PeerLostError: a peer's connection closed during (or before) the call.
            CollectiveTimeoutError: not complete within ``timeout_s``.
            MemoryBoundError: the call would buffer more than ``MAX_MEMORY_BYTES`` here.
        """
        if op not in ops.OPS:
            raise ValueError(f"op={op!r}: expected one of {sorted(ops.OPS)}")
        flat, how = ops.as_flat(x)
        out = await self._reduce(flat, ops.COLLS["all_reduce"], op, precision, 1.0)
        return ops.rebuild(out, how)

    async def federated_average(self, x: Any, weight: float) -> Any:
        """Sample-weighted mean: ``sum_i weight_i * x_i / sum_i weight_i`` over ranks.

        Accumulated in float64 in rank order, rounded once to float32; weights travel exactly
        (float64); ``x`` travels at f32.

        Args:
            x: float32 data as for :meth:`all_reduce`.
            weight: this rank's weight (e.g. its sample count): finite, >= 0.

        Returns:
            A new float32 array of ``x``'s type and shape, the same on every rank.

        Raises:
            ValueError: a bad ``weight`` (local); every weight 0 (on every rank).
            The errors of :meth:`all_reduce`.
        """
        w = ops.check_weight(weight)
        flat, how = ops.as_flat(x)
        out = await self._reduce(flat, ops.COLLS["federated_average"], "sum", "f32", w)
        return ops.rebuild(out, how)

    async def barrier(self) -> None:
        """Return once every rank has entered the barrier.

        Raises:
            The errors of :meth:`all_reduce`.
        """
        await self._reduce(ops.empty(0), ops.COLLS["barrier"], "sum", "f32", 1.0)

    async def _reduce(self, flat: Any, coll: int, op: str, precision: str, weight: float) -> Any:
        if precision not in ops.PRECISIONS:
            raise ValueError(f"precision={precision!r}: expected one of {sorted(ops.PRECISIONS)}")
        n = len(flat)
        if n > 0xFFFFFFFF:
            raise ValueError(f"x has {n} elements; at most 2**32-1")
        sig = ops.Sig(coll, ops.OPS[op], ops.PRECISIONS[precision], 0, n)
        deadline = self._begin(sig, self._estimate(n))
        try:
            if self.world == 1:
                return self._combine(sig, op, [self._q(flat, precision)], [weight], precision)
            if self.topology == "star":
                return await self._reduce_star(sig, flat, op, precision, weight, deadline)
            return await self._reduce_mesh(sig, flat, op, precision, weight, deadline)
        finally:
            self._seq += 1

    def _combine(self, sig: ops.Sig, op: str, parts: list, weights: list, precision: str) -> Any:
        if sig.coll == ops.COLLS["barrier"]:
            return parts[0]
        if sig.coll == ops.COLLS["federated_average"]:
            total = 0.0
            for w in weights:
                total += w
            if total <= 0.0:
                err = CollectiveMismatchError(f"collective #{self._seq}: federated_average weights sum to "
                                              f"{total!r}; at least one rank needs weight > 0")
                self._fail(err, notify=False)  # every deciding rank sees the same weights
                raise err
            return ops.weighted_mean(parts, weights)
        return self._q(ops.reduce(op, parts, self.world), precision)

    async def _reduce_star(self, sig, flat, op, precision, weight, deadline) -> Any:
        if self.rank != 0:
            self._send(sig, 0, flat, to=0, weight=weight)
            msg = await self._recv(self._seq, 0, 1, deadline)
            self._check(sig, msg)
            return ops.to_vec(msg["g"])
        parts, weights = [self._q(flat, precision)], [weight]
        for r in range(1, self.world):
            msg = await self._recv(self._seq, r, 0, deadline)
            self._check(sig, msg)
            parts.append(ops.to_vec(msg["g"]))
            weights.append(msg["loss"])
        try:
            res = self._combine(sig, op, parts, weights, precision)
        except CollectiveMismatchError as e:
            self._post_abort(ABORT_MISMATCH, str(e), self.rank)
            raise
        del parts
        self._send(sig, 1, res, to=None)  # res is already quantized: re-encoding is exact
        return res

    async def _reduce_mesh(self, sig, flat, op, precision, weight, deadline) -> Any:
        bounds = ops.shard_bounds(len(flat), self.world)
        me = self.rank
        for j in range(self.world):
            if j != me:
                lo, hi = bounds[j]
                self._send(sig, 0, flat[lo:hi], to=j, weight=weight)
        lo, hi = bounds[me]
        parts: list = [None] * self.world
        weights = [0.0] * self.world
        parts[me], weights[me] = self._q(flat[lo:hi], precision), weight
        for i in range(self.world):
            if i != me:
                msg = await self._recv(self._seq, i, 0, deadline)
                self._check(sig, msg)
                parts[i], weights[i] = ops.to_vec(msg["g"]), msg["loss"]
        mine = self._combine(sig, op, parts, weights, precision)
        del parts
        if sig.coll == ops.COLLS["barrier"]:
            return mine
        for j in range(self.world):
            if j != me:
                self._send(sig, 1, mine, to=j)
        out = ops.empty(len(flat))
        out[lo:hi] = mine
        for j in range(self.world):
            if j != me:
                msg = await self._recv(self._seq, j, 1, deadline)
                self._check(sig, msg)
                a, b = bounds[j]
                g = ops.to_vec(msg["g"])
                if len(g) != b - a:
                    raise CollectiveMismatchError(f"rank {j} sent a shard of {len(g)} elements, expected {b - a}")
                out[a:b] = g
        return out

    async def broadcast(self, x: Any, root: int = 0) -> Any:
        """Every rank gets ``root``'s ``x``.

        Args:
            x: float32 data as for :meth:`all_reduce`, the same number of elements on every rank
                (on non-root ranks only its length and type matter, as with torch's tensor).
            root: the sending rank, in [0, world).

        Returns:
            A new array of ``x``'s type and shape holding root's values, exactly (f32 on the wire).

        Raises:
            ValueError: ``root`` out of range (local).
            The errors of :meth:`all_reduce`.
        """
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.world:
            raise ValueError(f"root={root!r}: must be an int in [0, {self.world})")
        flat, how = ops.as_flat(x)
        n = len(flat)
        sig = ops.Sig(ops.COLLS["broadcast"], 0, 0, root, n)
        deadline = self._begin(sig, 4 * n * 2)
        try:
            if self.world == 1:
                out = flat
            elif self.topology == "star":
                out = await self._broadcast_via(sig, flat, root, hub=0, deadline=deadline)
            else:
                out = await self._broadcast_via(sig, flat, root, hub=root, deadline=deadline)
        finally:
            self._seq += 1
        return ops.rebuild(out, how)

    async def _broadcast_via(self, sig, flat, root: int, *, hub: int, deadline: float) -> Any:
        """Everyone sends its signature (root: its data) to ``hub``; the hub checks them all and
        sends the data to everyone (an ack to root). Mesh uses hub = root, star hub = 0."""
        empty = ops.empty(0)
        if self.rank != hub:
            self._send(sig, 0, flat if self.rank == root else empty, to=hub)
            msg = await self._recv(self._seq, hub, 1, deadline)
            self._check(sig, msg)
            return flat if self.rank == root else ops.to_vec(msg["g"])
        data = flat
        for r in range(self.world):
            if r != hub:
                msg = await self._recv(self._seq, r, 0, deadline)
                self._check(sig, msg)
                if r == root:
                    data = ops.to_vec(msg["g"])
        for r in range(self.world):
            if r != hub:
                self._send(sig, 1, empty if r == root else data, to=r)
        return data

    # -- teardown --------------------------------------------------------------------------
    async def close(self) -> None:
        """Tell peers this rank is leaving (so they see a departure, not a crash) and close."""
        if self.closed:
            return
        if self._error is None:
            self._post_abort(BYE, "closed", self.rank)
        self.closed = True
        try:
            await self.bus.flush(self.cfg.timeout_s)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        await self.bus.aclose()
        await self._stop_advertising()

    async def __aenter__(self) -> "ProcessGroup":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
