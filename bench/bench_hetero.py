"""Heterogeneous cohorts: how much of its ranks' summed solo throughput a cohort applies, with
speed-proportional shares of a fixed global batch (docs/PROTOCOL.md, "Shares").

**Cohort efficiency** = applied samples/s of the cohort / the sum over its ranks of that rank's
solo applied samples/s, each rank measured alone (a cohort of one, the same global batch) in the
same run and timed the same way. A rank of speed ``v`` computes a share of ``s`` samples in
``overhead + s / (v * unit)`` ms (``--unit``: samples per ms at speed 1). Cohorts:

- ``tab-like``: speeds {1, 1, 0.02}: two fast ranks and one 50x slower (a tab);
- ``spread4``: speeds {1, 0.5, 0.25, 0.1};
- ``spread16``: 16 ranks with speeds spread evenly from 1 down to 0.05.

Measured three times: in virtual time (``tabcohort.runtime.sim``: the same machines and in-memory bus on
a discrete-event clock, no CPU cost; deterministic for a seed), once with ranks that handle
inputs while they compute and once with ranks that do not (``blocking_compute``: as a native rank
and a tab's worker on the python or js backend, whose job runs in their event loop's turn, so a
peer's bucket waits behind the leader's own compute; docs/PROTOCOL.md "Shares"), and on the wall clock (one asyncio
loop: real ``RankMachine`` + ``RankDriver`` + in-memory bus, the compute an awaited sleep, so the
two cores are not the limit; the rank machines' own message handling is). A wall-clock window
starts and ends at a round boundary, so a slow solo rank is measured over whole rounds.

Then accuracy: digits with the MLP, in process, a heterogeneous cohort (speeds of ``spread4``)
against a homogeneous one (4 ranks of speed 1) at the same global batch, the same number of
rounds: held-out accuracy of both and their difference. (The shares cover consecutive windows from
one cursor and the reduce is sample-weighted, so both cohorts take the same samples per round.)

Writes ``bench/results/hetero.json`` (``efficiency_virtual``, ``efficiency_virtual_blocking`` and
``efficiency_wall``: cohort name -> efficiency; ``accuracy``; and the rows) and prints Markdown tables.

Usage: PYTHONPATH=client_py python bench/bench_hetero.py [--quick] [--seconds 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "client_py"))

from tabcohort.bus.memory import MemoryNetwork  # noqa: E402
from tabcohort.model.toy import ToyWorker  # noqa: E402
from tabcohort.protocol import RankMachine  # noqa: E402
from tabcohort.runtime.driver import RankDriver  # noqa: E402
from tabcohort.runtime.sim import SimCohort  # noqa: E402
from tabcohort.sched import AsyncioScheduler  # noqa: E402

#: cohort name -> (speeds, global batch)
COHORTS = {
    "tab-like": ([1.0, 1.0, 0.02], 64),
    "spread4": ([1.0, 0.5, 0.25, 0.1], 64),
    "spread16": ([round(1.0 - 0.95 * i / 15, 4) for i in range(16)], 256),
}
BUCKET_LEN = 8
GOAL_VIRTUAL, GOAL_WALL, GOAL_ACCURACY = 0.90, 0.80, 0.005
#: the table's names of the three measurements
CLOCKS = {"virtual": "virtual", "virtual_blocking": "virtual, blocking compute", "wall": "wall"}


# ------------------------------------------------------------------ virtual time
def virtual(speeds: list[float], global_batch: int, seconds: float, unit: float, overhead_ms: float,
            seed: int = 5, blocking: bool = False) -> dict:
    """One cohort in virtual time; applied samples/s over ``seconds`` after a 4 s warm-up.
    ``blocking``: every rank handles no input while it computes (a native rank, a tab's worker
    on the python or js backend: their job runs in their event loop's turn)."""
    sim = SimCohort(seed=seed)
    sim.network.set_default_link(delay_ms=0.2, jitter_ms=0.1)
    for i, v in enumerate(speeds, 1):
        sim.add(i, ToyWorker(bucket_len=BUCKET_LEN, batch=global_batch), compute_ms=overhead_ms,
                ms_per_sample=1.0 / (v * unit), ready=(i == 1), collect_rule="grace", global_batch=global_batch,
                blocking_compute=blocking)
    sim.run_until(4000.0)
    lead = sim.ranks[1].machine
    a0, s0 = lead._applied_samples, lead.step
    sim.run_until(4000.0 + seconds * 1000.0)
    st = lead.state(sim.now_ms())
    return {"applied_per_s": (lead._applied_samples - a0) / seconds, "rounds_per_s": (lead.step - s0) / seconds,
            "shares": st["shares"]}


# ------------------------------------------------------------------ wall clock
class PacedToyWorker(ToyWorker):
    """The toy worker whose bucket of ``s`` samples takes ``overhead_ms + s / (speed * unit)``
    ms of awaited (not CPU) time."""

    def __init__(self, *, speed: float, unit: float, overhead_ms: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.ms_per_sample = 1.0 / (speed * unit)
        self.overhead_ms = overhead_ms

    async def grads(self, offset: int, samples: int | None = None) -> tuple[float, Any]:
        result = self.grads_sync(offset, samples)
        n = self.batch if samples is None else samples
        await asyncio.sleep((self.overhead_ms + n * self.ms_per_sample) / 1000.0)
        return result


class Paced:
    """Any worker, slowed: its bucket of ``s`` samples takes ``s / (speed * unit)`` ms more
    (awaited). Everything else is the wrapped worker's."""

    def __init__(self, inner: Any, speed: float, unit: float) -> None:
        self._inner = inner
        self._ms_per_sample = 1.0 / (speed * unit)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def grads(self, offset: int, samples: int | None = None) -> tuple[float, Any]:
        result = await self._inner.grads(offset, samples)
        n = self._inner.batch if samples is None else samples
        await asyncio.sleep(n * self._ms_per_sample / 1000.0)
        return result


class WallCohort:
    """Ranks 1..n on one in-memory network on the running loop (rank 1 bootstraps)."""

    def __init__(self, workers: list[Any], global_batch: int, job: str, lr: float, eval_every: int = 0) -> None:
        loop = asyncio.get_running_loop()
        self.net = MemoryNetwork(AsyncioScheduler(loop), seed=0, log=False)
        self.drivers = []
        for k, w in enumerate(workers, 1):
            bus = self.net.attach(k)
            m = RankMachine(k, w, bus, job=job, now_ms=RankDriver.clock_ms(loop), lr=lr, ready=(k == 1),
                            collect_rule="grace", eval_every=eval_every, global_batch=global_batch)
            self.drivers.append(RankDriver(m, w, bus))
        for d in self.drivers:
            d.start()
        self.lead = self.drivers[0].machine

    async def until(self, cond, timeout_s: float, what: str, poll_s: float = 0.002) -> None:
        t_end = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > t_end:
                raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
            await asyncio.sleep(poll_s)

    async def warm_up(self, rounds: int, timeout_s: float = 60.0) -> None:
        n = len(self.drivers)
        d0 = self.drivers[0]
        await self.until(lambda: len(self.lead.cohort_ids(d0.now_ms())) == n and self.lead.policy.n == n,
                         timeout_s, f"a cohort of {n}", poll_s=0.01)
        s0 = self.lead.step
        await self.until(lambda: self.lead.step >= s0 + rounds, timeout_s, f"{rounds} warm-up rounds", poll_s=0.01)

    async def measure(self, min_s: float, min_rounds: int, timeout_s: float = 120.0) -> dict:
        """Applied samples/s from one round boundary to the first after ``min_s`` and
        ``min_rounds`` rounds."""
        s = self.lead.step
        await self.until(lambda: self.lead.step != s, timeout_s, "a round boundary")
        t0, s0, a0 = time.monotonic(), self.lead.step, self.lead._applied_samples
        cpu0 = time.process_time()
        await self.until(lambda: time.monotonic() - t0 >= min_s and self.lead.step >= s0 + min_rounds,
                         timeout_s, "the measuring window")
        s1 = self.lead.step
        await self.until(lambda: self.lead.step != s1, timeout_s, "a round boundary")
        dt = time.monotonic() - t0
        st = self.lead.state(self.drivers[0].now_ms())
        return {"applied_per_s": (self.lead._applied_samples - a0) / dt, "rounds_per_s": (self.lead.step - s0) / dt,
                "seconds": round(dt, 3), "cpu_per_s": (time.process_time() - cpu0) / dt, "shares": st["shares"],
                "speeds": st["speeds"]}

    async def close(self) -> None:
        for d in self.drivers:
            await d.close()


def toy(v: float, global_batch: int, unit: float, overhead_ms: float) -> PacedToyWorker:
    return PacedToyWorker(speed=v, unit=unit, overhead_ms=overhead_ms, bucket_len=BUCKET_LEN, batch=global_batch)


async def wall(speeds: list[float], global_batch: int, seconds: float, unit: float, overhead_ms: float) -> dict:
    c = WallCohort([toy(v, global_batch, unit, overhead_ms) for v in speeds], global_batch, "bench-hetero", 0.01)
    try:
        await c.warm_up(rounds=30)
        return await c.measure(seconds, min_rounds=10)
    finally:
        await c.close()


async def wall_solos(speeds: list[float], global_batch: int, seconds: float, unit: float,
                     overhead_ms: float) -> list[dict]:
    """Every rank alone, all solos at once (each its own network; they mostly sleep)."""
    async def one(v: float) -> dict:
        c = WallCohort([toy(v, global_batch, unit, overhead_ms)], global_batch, "bench-hetero", 0.01)
        try:
            await c.warm_up(rounds=1)
            return await c.measure(min(seconds, 1.0), min_rounds=2)
        finally:
            await c.close()
    return list(await asyncio.gather(*(one(v) for v in speeds)))


# ------------------------------------------------------------------ accuracy
async def accuracy_run(speeds: list[float], global_batch: int, rounds: int, unit: float, lr: float) -> dict:
    from tabcohort.model import load_dataset, make_worker
    from tabcohort.protocol import job_hash
    from tabcohort.vec import digest

    ds = load_dataset("digits", seed=0)
    workers = [Paced(make_worker(ds, hidden=(32,), batch=global_batch, seed=0), v, unit) for v in speeds]
    w0 = workers[0]
    c = WallCohort(workers, global_batch, job_hash(w0.spec(), ds.content_hash(), w0.bucket_len), lr)
    t0 = time.monotonic()
    try:
        await c.until(lambda: c.lead.step >= rounds, 600.0, f"{rounds} rounds", poll_s=0.01)
        for d in c.drivers:
            d.stop()
        await c.until(lambda: len({digest(d.worker.params()) for d in c.drivers}) == 1, 30.0,
                      "every rank bit-identical after the publish", poll_s=0.01)
        st = c.lead.state(c.drivers[0].now_ms())
        return {"speeds": speeds, "rounds": c.lead.step, "samples": c.lead._applied_samples,
                "accuracy": float(c.lead.worker.evaluate()), "seconds": round(time.monotonic() - t0, 2),
                "shares_last": st["shares"]}
    finally:
        await c.close()


# ------------------------------------------------------------------ main
async def main_async(a) -> dict:
    load0 = os.getloadavg()
    cohorts = {}
    for name, (speeds, gb) in COHORTS.items():
        v = virtual(speeds, gb, a.sim_seconds, a.unit, a.overhead_ms)
        v_solo = [virtual([s], gb, a.sim_seconds, a.unit, a.overhead_ms) for s in speeds]
        b = virtual(speeds, gb, a.sim_seconds, a.unit, a.overhead_ms, blocking=True)
        b_solo = [virtual([s], gb, a.sim_seconds, a.unit, a.overhead_ms, blocking=True) for s in speeds]
        w = await wall(speeds, gb, a.seconds, a.unit, a.overhead_ms)
        w_solo = await wall_solos(speeds, gb, a.seconds, a.unit, a.overhead_ms)
        cohorts[name] = {
            "speeds": speeds, "global_batch": gb,
            "virtual": {"cohort": v, "solo_applied_per_s": [r["applied_per_s"] for r in v_solo],
                        "efficiency": v["applied_per_s"] / sum(r["applied_per_s"] for r in v_solo)},
            "virtual_blocking": {"cohort": b, "solo_applied_per_s": [r["applied_per_s"] for r in b_solo],
                                 "efficiency": b["applied_per_s"] / sum(r["applied_per_s"] for r in b_solo)},
            "wall": {"cohort": w, "solo_applied_per_s": [r["applied_per_s"] for r in w_solo],
                     "efficiency": w["applied_per_s"] / sum(r["applied_per_s"] for r in w_solo)}}
    speeds = COHORTS["spread4"][0]
    hetero = await accuracy_run(speeds, a.acc_global_batch, a.acc_rounds, a.unit, a.acc_lr)
    homo = await accuracy_run([1.0] * len(speeds), a.acc_global_batch, a.acc_rounds, a.unit, a.acc_lr)
    load1 = os.getloadavg()
    return {"bench": "bench_hetero", "unit_samples_per_ms": a.unit, "overhead_ms": a.overhead_ms,
            "seconds": a.seconds, "sim_seconds": a.sim_seconds, "loadavg_1min": [load0[0], load1[0]],
            "cpus": os.cpu_count(),
            "efficiency_virtual": {k: c["virtual"]["efficiency"] for k, c in cohorts.items()},
            "efficiency_wall": {k: c["wall"]["efficiency"] for k, c in cohorts.items()},
            "efficiency_virtual_blocking": {k: c["virtual_blocking"]["efficiency"] for k, c in cohorts.items()},
            "accuracy": {"dataset": "digits", "model": "mlp hidden 32", "global_batch": a.acc_global_batch,
                         "rounds": a.acc_rounds, "lr": a.acc_lr, "heterogeneous": hetero, "homogeneous": homo,
                         "difference": hetero["accuracy"] - homo["accuracy"]},
            "goals": {"efficiency_virtual": GOAL_VIRTUAL, "efficiency_wall": GOAL_WALL,
                      "accuracy_difference": GOAL_ACCURACY},
            "cohorts": cohorts}


def speeds_text(speeds: list[float]) -> str:
    if len(speeds) > 6:
        return f"{len(speeds)} ranks, {max(speeds):g}..{min(speeds):g}"
    return "{" + ", ".join(f"{s:g}" for s in speeds) + "}"


def print_tables(r: dict) -> None:
    print(f"# heterogeneous cohorts: speed-proportional shares of a fixed global batch; speed 1 = "
          f"{r['unit_samples_per_ms']:g} samples/ms, {r['overhead_ms']:g} ms fixed cost per bucket; load average "
          f"{r['loadavg_1min'][0]:.1f} -> {r['loadavg_1min'][1]:.1f} on {r['cpus']} cpus\n")
    print("| cohort | speeds | global batch | clock | cohort applied samples/s | sum of solo applied samples/s "
          "| rounds/s | efficiency |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for name, c in r["cohorts"].items():
        for clock in ("virtual", "virtual_blocking", "wall"):
            x = c[clock]
            print(f"| {name} | {speeds_text(c['speeds'])} | {c['global_batch']} | {CLOCKS[clock]} | "
                  f"{x['cohort']['applied_per_s']:.0f} | {sum(x['solo_applied_per_s']):.0f} | "
                  f"{x['cohort']['rounds_per_s']:.1f} | **{x['efficiency'] * 100:.1f} %** |")
    acc = r["accuracy"]
    print(f"\n| digits MLP, global batch {acc['global_batch']}, {acc['rounds']} rounds | speeds | held-out accuracy "
          f"| wall s |")
    print("|---|---|---:|---:|")
    for k in ("heterogeneous", "homogeneous"):
        x = acc[k]
        print(f"| {k} | {speeds_text(x['speeds'])} | {x['accuracy'] * 100:.2f} % | {x['seconds']:.1f} |")
    print(f"\naccuracy difference (heterogeneous - homogeneous): {acc['difference'] * 100:+.2f} points")
    bad = [f"{clock} {k}: {v:.3f}" for clock, goal in (("virtual", GOAL_VIRTUAL), ("virtual_blocking", GOAL_VIRTUAL),
                                                        ("wall", GOAL_WALL))
           for k, v in r[f"efficiency_{clock}"].items() if v < goal]
    if abs(acc["difference"]) > GOAL_ACCURACY:
        bad.append(f"accuracy difference {acc['difference']:+.4f}")
    print("goals (efficiency >= 0.90 virtual, >= 0.80 wall; accuracy within 0.5 points): "
          + ("met" if not bad else "NOT met: " + "; ".join(bad)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter windows (about a minute and a half)")
    ap.add_argument("--seconds", type=float, default=6.0, help="wall-clock window per cohort (s)")
    ap.add_argument("--sim-seconds", type=float, default=20.0, help="virtual seconds per simulated row")
    ap.add_argument("--unit", type=float, default=1.0, help="samples per ms of a rank of speed 1")
    ap.add_argument("--overhead-ms", type=float, default=0.5, help="fixed cost per bucket (ms)")
    ap.add_argument("--acc-rounds", type=int, default=300, help="rounds of the accuracy runs")
    ap.add_argument("--acc-global-batch", type=int, default=64)
    ap.add_argument("--acc-lr", type=float, default=0.5)
    ap.add_argument("--json", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results" / "hetero.json")
    a = ap.parse_args()
    if a.quick:
        a.seconds, a.sim_seconds, a.acc_rounds = min(a.seconds, 3.0), min(a.sim_seconds, 10.0), min(a.acc_rounds, 200)
    r = asyncio.run(main_async(a))
    print_tables(r)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(r, indent=2) + "\n")
    print(f"\nJSON: {a.json}")


if __name__ == "__main__":
    main()
