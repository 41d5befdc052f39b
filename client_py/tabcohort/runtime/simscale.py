"""How the cohort protocol scales with the cohort size, by discrete-event simulation.

One room of ``n`` ranks on :class:`~tabcohort.runtime.sim.SimCohort` (the production
:class:`~tabcohort.protocol.RankMachine`, virtual time, the in-memory bus), in three phases:

1. **form**: all ``n`` ranks start; run until one leader drives rounds for a cohort of ``n``.
2. **steady** (``steady_ms``): rounds/s (virtual), beat messages each rank sends and receives
   per second, bytes into the leader per round (its bus's received bytes, every peer and message
   kind, chunk headers included), and the leader's round frame size.
3. **churn**: ``joins`` new ranks join, ``leaves`` ranks stop (a clean leave), and the leader is
   killed ``kills`` times; time to re-elect = from the kill to the first round a new leader sends
   (PROTOCOL.md, "Leader": a takeover after ``policy.takeover`` without rounds, or at once when the
   room's server witnesses the link close, ``witness=True``).

Every figure is in virtual time and follows from PROTOCOL.md's cohort-size policy (``policy(n)``:
the beat stretches as ``beat_ms * n / 4``, so each rank beats less often but receives ``n - 1``
peers' beats, about ``4 / beat_ms`` per second whatever ``n``); README "Scaling limits".
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..model.toy import ToyWorker
from ..protocol.policy import Timing, policy
from .sim import SimCohort, SimRank


@dataclass
class ScaleResult:
    """One cohort size's figures (virtual time unless ``_wall``)."""

    n: int
    params: int
    formed_ms: float | None = None
    rounds_per_s: float = 0.0
    beats_sent_per_rank_per_s: float = 0.0
    beats_received_per_rank_per_s: float = 0.0
    bytes_into_leader_per_round: float = 0.0
    grads_into_leader_per_round: float = 0.0
    round_frame_bytes: float = 0.0
    beats_per_join: float = 0.0
    reelect_ms: list[float] = field(default_factory=list)
    reelect_bound_ms: float = 0.0
    policy_beat_ms: float = 0.0
    policy_takeover_ms: float = 0.0
    joins: int = 0
    leaves: int = 0
    kills: int = 0
    witness: bool = True
    rounds_after_churn: int = 0
    leaders_after_churn: int = 0
    bit_identical: bool | None = None
    deliveries: int = 0
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Tally:
    """Counts what each rank receives, by message kind (a tap on each rank's bus)."""

    def __init__(self) -> None:
        self.beats_rx = 0
        self.rounds: list[tuple[float, int, int, int]] = []   # (time, sender, step, term), first receipt
        self._seen: set[tuple[int, int, int]] = set()
        self.grads_to: dict[int, int] = {}
        self.beats_tx: dict[int, int] = {}
        self.deliveries = 0

    def tap(self, sim: SimCohort, r: SimRank) -> None:
        inner = r.bus.on_message

        def on_message(msg: dict, rid: int = r.id) -> None:
            self.deliveries += 1
            t = msg.get("t")
            if t == "beat":
                self.beats_rx += 1
            elif t == "round":
                key = (msg["from"], msg["step"], msg["term"])
                if key not in self._seen:
                    self._seen.add(key)
                    self.rounds.append((sim.now_ms(), msg["from"], msg["step"], msg["term"]))
            elif t == "grad":
                self.grads_to[rid] = self.grads_to.get(rid, 0) + 1
            if inner is not None:
                inner(msg)
        r.bus.on_message = on_message
        post = r.bus.post

        def counted_post(msg: dict, rid: int = r.id) -> None:
            if msg.get("t") == "beat":
                self.beats_tx[rid] = self.beats_tx.get(rid, 0) + 1
            post(msg)
        r.bus.post = counted_post  # type: ignore[method-assign]


def _warm_start(sim: SimCohort, tally: _Tally, n: int, *, params: int, compute_ms: float,
                global_batch: int) -> None:
    """Ranks ``1..n`` as a cohort that has already formed: each starts ready (as ranks resuming
    one checkpoint do, identical parameters), its roster fed one beat from every other rank
    through :meth:`RankMachine.handle` (the machine's own input; no network), and its start-time
    ``hello`` posts not sent (:attr:`SimCohort.deliver_hello`). Rank 1 (the lowest id of equal
    lineages), started last, then leads
    (PROTOCOL.md, "Heartbeat and takeover"); nothing else differs from a cold start."""
    # each rank is made and started at its own time, spread over one stretched beat period, so the ranks' beat phases are spread as in a cohort that formed over time
    spread_ms = policy(n, sim.timing).beat_ms
    t0 = sim.now_ms()
    beats = [{"t": "beat", "from": k, "batch": 2, "ready": True, "running": True, "step": 0,
              "backend": "python", "term": 0} for k in range(1, n + 1)]

    def make(k: int) -> None:
        sim.deliver_hello = False
        r = sim.add(k, ToyWorker(bucket_len=params, batch=2), compute_ms=compute_ms, lr=0.05,
                    global_batch=global_batch, start=False, ready=True)
        now = sim.now_ms()
        for beat in beats:
            if beat["from"] != k:
                r.machine.handle(beat, now_ms=now)
        r.machine.drain()       # what the seeding produced (reports) is not part of the run
        tally.tap(sim, r)
        r.start()
        sim.deliver_hello = True
    # ranks 2..n first (nobody leads: rank 1, the lowest id, is not there yet), rank 1 last
    order = list(range(2, n + 1)) + [1]
    for i, k in enumerate(order):
        sim.at(t0 + spread_ms * i / n, lambda k=k: make(k))
    sim.run_until(t0 + spread_ms * (n - 1) / n)


def _leader(sim: SimCohort) -> SimRank | None:
    now = sim.now_ms()
    leads = [r for r in sim.alive() if r.machine.is_leader(now) and r.machine.looping]
    return leads[0] if len(leads) == 1 else None


def run_scale(n: int, *, params: int = 64, seed: int = 0, steady_ms: float = 10_000.0, joins: int = 0,
              leaves: int = 0, kills: int = 1, witness: bool = True, compute_ms: float = 20.0,
              form_limit_ms: float = 120_000.0, settle: bool = True, timing: Timing = Timing(),
              warm: bool = True) -> ScaleResult:
    """Simulate one room of ``n`` ranks (module docstring) and return its figures.

    Args:
        n: ranks at the start (>= 2).
        params: parameters of the toy model (float32 each on the wire).
        steady_ms: length of the measurement window, virtual ms.
        joins, leaves, kills: churn after the window (kills: the current leader each time).
        witness: the server witnesses a killed rank's link close (the star); ``False`` = no witness
            (the re-election then waits for ``policy(n).takeover_ms``).
        settle: stop every rank at the end and check they end bit-identical.
        warm: start the ``n`` ranks as a formed cohort (:func:`_warm_start`) instead of ``n``
            simultaneous joins (a cold start costs about ``n**3`` deliveries: every ``hello``
            makes each of the ``n - 1`` others broadcast a beat, PROTOCOL.md "Joining").
    """
    t_wall = time.perf_counter()
    sim = SimCohort(seed=seed, timing=timing, witness=witness, log=False)
    tally = _Tally()
    next_id = [1]

    def add() -> SimRank:
        k = next_id[0]
        next_id[0] += 1
        r = sim.add(k, ToyWorker(bucket_len=params, batch=2), compute_ms=compute_ms, lr=0.05,
                    global_batch=2 * n, start=False)
        tally.tap(sim, r)
        r.start()
        return r

    if warm:
        _warm_start(sim, tally, n, params=params, compute_ms=compute_ms, global_batch=2 * n)
        next_id[0] = n + 1
    else:
        for _ in range(n):
            add()
    res = ScaleResult(n=n, params=params, witness=witness, joins=joins, leaves=leaves, kills=kills)
    pol = policy(n, timing)
    res.policy_beat_ms, res.policy_takeover_ms = pol.beat_ms, pol.takeover_ms
    res.reelect_bound_ms = (0.0 if witness else pol.takeover_ms) + pol.collect_ms + 2 * pol.beat_ms

    def formed() -> bool:
        lead = _leader(sim)
        return lead is not None and len(lead.machine.cohort_ids(sim.now_ms())) >= n and bool(tally.rounds)
    if not sim.run_while(lambda: not formed(), limit_ms=form_limit_ms, step_ms=100.0):
        res.wall_s = time.perf_counter() - t_wall
        return res
    res.formed_ms = sim.now_ms()
    # the steady window
    lead = _leader(sim)
    t0 = sim.now_ms()
    rx0 = sum(b.received for b in lead.bus.bytes().values())
    grads0 = tally.grads_to.get(lead.id, 0)
    n_rounds0 = len(tally.rounds)
    frames0, bytes0 = lead.bus.writer.n_frames, lead.bus.writer.n_bytes
    beats_rx0, beats_tx0 = tally.beats_rx, sum(tally.beats_tx.values())
    sim.run_until(t0 + steady_ms)
    secs = (sim.now_ms() - t0) / 1000.0
    rounds = [x for x in tally.rounds[n_rounds0:] if x[1] == lead.id]
    res.rounds_per_s = len(rounds) / secs
    if rounds:
        res.bytes_into_leader_per_round = (sum(b.received for b in lead.bus.bytes().values()) - rx0) / len(rounds)
        res.grads_into_leader_per_round = (tally.grads_to.get(lead.id, 0) - grads0) / len(rounds)
    # (the warm start spreads the ranks' beat phases over one period, so a window shorter than
    # the stretched beat still samples beats evenly)
    res.beats_received_per_rank_per_s = (tally.beats_rx - beats_rx0) / n / secs
    res.beats_sent_per_rank_per_s = (sum(tally.beats_tx.values()) - beats_tx0) / n / secs
    nf = lead.bus.writer.n_frames - frames0
    # the leader's frames are rounds and beats; a round dominates: bytes per frame it wrote
    res.round_frame_bytes = (lead.bus.writer.n_bytes - bytes0) / nf if nf else 0.0
    # churn: joins, leaves, then leader kills
    per_join = []
    for _ in range(joins):
        b0, t_join = tally.beats_rx, sim.now_ms()
        add()
        sim.run_until(t_join + 100.0)
        # beats the join caused: every member answers each hello with a beat addressed to the joiner
        per_join.append(tally.beats_rx - b0 - res.beats_received_per_rank_per_s * n * 0.1)
    res.beats_per_join = sum(per_join) / len(per_join) if per_join else 0.0
    alive = [r for r in sim.alive() if r is not lead]
    for r in alive[-leaves:] if leaves else []:
        r.stop()
    sim.run_until(sim.now_ms() + pol.collect_ms)   # a clean leave is announced at once (a beat)
    for _ in range(kills):
        lead = _leader(sim)
        if lead is None:
            sim.run_while(lambda: _leader(sim) is None, limit_ms=sim.now_ms() + 4 * pol.takeover_ms, step_ms=100.0)
            lead = _leader(sim)
            if lead is None:
                break
        t_kill = sim.now_ms()
        killed = lead.id
        n_before = len(tally.rounds)
        lead.kill()

        def new_round() -> bool:
            return any(s != killed for _, s, _, _ in tally.rounds[n_before:])
        sim.run_while(lambda: not new_round(), limit_ms=t_kill + pol.takeover_ms + 4 * pol.drop_ms, step_ms=50.0)
        firsts = [t for t, s, _, _ in tally.rounds[n_before:] if s != killed]
        res.reelect_ms.append(firsts[0] - t_kill if firsts else float("inf"))
    n_after = len(tally.rounds)
    sim.run_until(sim.now_ms() + 2000.0)
    after = tally.rounds[n_after:]
    res.rounds_after_churn = len(after)
    res.leaders_after_churn = len({s for _, s, _, _ in after})
    if settle:
        running = [r for r in sim.alive() if r.machine.looping or r.machine.running]
        for r in running:
            r.stop()
        sim.run_while(lambda: any(r.machine.looping for r in sim.alive()), limit_ms=sim.now_ms() + 60_000)
        sim.run_until(sim.now_ms() + 2 * timing.beat_ms)
        from ..vec import digest
        res.bit_identical = len({digest(r.worker.params()) for r in running if r.alive}) == 1
    res.deliveries = tally.deliveries
    res.wall_s = time.perf_counter() - t_wall
    return res
