"""Scaling of an in-process cohort with a simulated compute time per bucket, for the
PROTOCOL.md quorum rule and our grace rule (docs/PROTOCOL-NOTES.md, note 7), side by side.

Each rank's bucket takes ``--compute-ms`` of *awaited* time (not CPU), so two cores do not
limit scaling. Reported per N and rule: rounds/s, the round rate relative to N = 1, samples
computed/s (every bucket computed), samples applied/s (buckets that entered a reduce), kept
(applied / computed) and applied efficiency ``applied/s(N) / (N * applied/s(1))``, which is
about ``round rate vs N=1 x kept``. So a loss shows up either as dropped buckets (the rule)
or as a slower round rate (the runtime: N ranks' message handling in one Python process, on
cores other jobs share; ``cpu`` is this process's CPU seconds per wall second). Then the
straggler check: one rank 10x slower, round rate relative to the same cohort without it.

The same two tables are then computed in virtual time (``tabcohort.runtime.sim``: the same
machines and in-memory bus on a discrete-event clock, ``--sim-jitter-ms`` of uniform link
jitter per message, no CPU cost): what the rule does when the host is not the bottleneck,
deterministic for a seed.

The wall-clock rows are noisy on shared machines: the rules are interleaved per N and each row
is the median of ``--repeat`` runs by applied/s; compare rules within one run, as ratios.

Usage: python bench/bench_scaling.py [--seconds 4] [--compute-ms 50] [--ns 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "client_py"))

from tabcohort.bus.memory import MemoryNetwork  # noqa: E402
from tabcohort.model.toy import ToyWorker  # noqa: E402
from tabcohort.protocol import RankMachine  # noqa: E402
from tabcohort.runtime.driver import RankDriver  # noqa: E402
from tabcohort.runtime.sim import SimCohort  # noqa: E402
from tabcohort.sched import AsyncioScheduler  # noqa: E402

BATCH = 8
RULES = ("quorum", "grace")
STRAGGLER_NS = (4, 8, 16)


async def run(n: int, rule: str, seconds: float, compute_ms: float, slow: int = 0) -> dict:
    """One in-process cohort on the asyncio loop (wall clock)."""
    loop = asyncio.get_running_loop()
    net = MemoryNetwork(AsyncioScheduler(loop), seed=0, log=False)
    drivers = []
    for k in range(1, n + 1):
        c = compute_ms * (10 if k == n and slow else 1)      # the highest id is the straggler
        w = ToyWorker(bucket_len=64, batch=BATCH, compute_ms=c)
        bus = net.attach(k)
        m = RankMachine(k, w, bus, job="bench", now_ms=RankDriver.clock_ms(loop), lr=0.01,
                        ready=(k == 1), collect_rule=rule, eval_every=0)
        drivers.append(RankDriver(m, w, bus))
    for d in drivers:
        d.start()
    lead = drivers[0].machine
    for _ in range(500):                                       # warm up: whole cohort in
        await asyncio.sleep(0.01)
        if len(lead.cohort_ids(drivers[0].now_ms())) == n and lead.policy.n == n:
            break
    await asyncio.sleep(0.5)                                   # and a few rounds of history
    s0, b0 = lead.step, lead.counters["buckets_reduced"]
    c0 = sum(d.worker.calls for d in drivers)
    t0, cpu0 = loop.time(), time.process_time()
    await asyncio.sleep(seconds)
    dt, cpu = loop.time() - t0, time.process_time() - cpu0
    rounds = lead.step - s0
    applied = (lead.counters["buckets_reduced"] - b0) * BATCH
    computed = (sum(d.worker.calls for d in drivers) - c0) * BATCH
    for d in drivers:
        await d.close()
    return {"n": n, "rule": rule, "slow": slow, "rounds_per_s": rounds / dt, "computed_per_s": computed / dt,
            "applied_per_s": applied / dt, "cpu_per_s": cpu / dt}


def run_virtual(n: int, rule: str, seconds: float, compute_ms: float, jitter_ms: float,
                slow: int = 0) -> dict:
    """The same cohort in virtual time (discrete-event simulation: no CPU cost, seeded)."""
    sim = SimCohort(seed=0)
    if jitter_ms > 0:
        sim.network.set_default_link(jitter_ms=jitter_ms)
    ranks = [sim.add(k, ToyWorker(bucket_len=64, batch=BATCH), ready=(k == 1), collect_rule=rule, lr=0.01,
                     compute_ms=compute_ms * (10 if k == n and slow else 1)) for k in range(1, n + 1)]
    sim.run_until(4000.0)                                       # warm up: cohort and policy
    lead = ranks[0].machine
    s0, b0, c0 = lead.step, lead.counters["buckets_reduced"], sum(r.worker.calls for r in ranks)
    sim.run_until(4000.0 + seconds * 1000.0)
    return {"n": n, "rule": rule, "slow": slow, "rounds_per_s": (lead.step - s0) / seconds,
            "computed_per_s": (sum(r.worker.calls for r in ranks) - c0) * BATCH / seconds,
            "applied_per_s": (lead.counters["buckets_reduced"] - b0) * BATCH / seconds}


def derive(rows: list[dict]) -> None:
    base = {r["rule"]: r for r in rows if r["n"] == 1}
    for r in rows:
        b = base[r["rule"]]
        r["round_rate_vs_1"] = r["rounds_per_s"] / b["rounds_per_s"]
        r["kept"] = r["applied_per_s"] / r["computed_per_s"] if r["computed_per_s"] else 0.0
        r["applied_efficiency"] = r["applied_per_s"] / (r["n"] * b["applied_per_s"])


async def main_async(a) -> dict:
    ns = [int(x) for x in a.ns.split(",")]
    load0 = os.getloadavg()
    rows = []
    for i, n in enumerate(ns):
        runs: dict[str, list[dict]] = {rule: [] for rule in RULES}
        for rep in range(a.repeat):
            order = RULES if (i + rep) % 2 == 0 else RULES[::-1]   # interleaved, order alternated
            for rule in order:
                runs[rule].append(await run(n, rule, a.seconds, a.compute_ms))
        for rule in RULES:
            rs = sorted(runs[rule], key=lambda r: r["applied_per_s"])
            rows.append(rs[(len(rs) - 1) // 2])                      # median (lower) by applied/s
    derive(rows)
    strag = []
    for n in STRAGGLER_NS:
        for rule in RULES:
            fast = await run(n, rule, a.seconds, a.compute_ms)
            slow = await run(n, rule, a.seconds, a.compute_ms, slow=1)
            strag.append({"n": n, "rule": rule, "rounds_per_s": fast["rounds_per_s"],
                          "rounds_per_s_with_straggler": slow["rounds_per_s"],
                          "ratio": slow["rounds_per_s"] / fast["rounds_per_s"]})
    load1 = os.getloadavg()
    vrows = [run_virtual(n, rule, a.sim_seconds, a.compute_ms, a.sim_jitter_ms) for n in ns for rule in RULES]
    derive(vrows)
    vstrag = []
    for n in STRAGGLER_NS:
        for rule in RULES:
            fast = run_virtual(n, rule, a.sim_seconds, a.compute_ms, a.sim_jitter_ms)
            slow = run_virtual(n, rule, a.sim_seconds, a.compute_ms, a.sim_jitter_ms, slow=1)
            vstrag.append({"n": n, "rule": rule, "rounds_per_s": fast["rounds_per_s"],
                           "rounds_per_s_with_straggler": slow["rounds_per_s"],
                           "ratio": slow["rounds_per_s"] / fast["rounds_per_s"]})
    return {"compute_ms": a.compute_ms, "seconds": a.seconds, "repeat": a.repeat, "batch": BATCH,
            "loadavg_1min": [load0[0], load1[0]], "cpus": os.cpu_count(), "scaling": rows,
            "straggler": strag, "virtual": {"jitter_ms": a.sim_jitter_ms, "seconds": a.sim_seconds,
                                            "scaling": vrows, "straggler": vstrag}}


def print_tables(rows: list[dict], strag: list[dict], cpu: bool) -> None:
    print("| N | rule | rounds/s | round rate vs N=1 | computed samples/s | applied samples/s | kept "
          "| applied efficiency |" + (" cpu |" if cpu else ""))
    print("|---:|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if cpu else ""))
    for x in rows:
        print(f"| {x['n']} | {x['rule']} | {x['rounds_per_s']:.1f} | {x['round_rate_vs_1'] * 100:.0f} % | "
              f"{x['computed_per_s']:.0f} | {x['applied_per_s']:.0f} | {x['kept'] * 100:.0f} % | "
              f"**{x['applied_efficiency'] * 100:.0f} %** |" + (f" {x['cpu_per_s']:.2f} |" if cpu else ""))
    print("\n| N | rule | rounds/s | rounds/s, one rank 10x slower | ratio |")
    print("|---:|---|---:|---:|---:|")
    for x in strag:
        print(f"| {x['n']} | {x['rule']} | {x['rounds_per_s']:.1f} | {x['rounds_per_s_with_straggler']:.1f} | "
              f"{x['ratio'] * 100:.0f} % |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=2, help="wall-clock runs per row (median)")
    ap.add_argument("--compute-ms", type=float, default=50.0)
    ap.add_argument("--ns", default="1,2,4,8,16")
    ap.add_argument("--sim-seconds", type=float, default=20.0, help="virtual seconds per simulated row")
    ap.add_argument("--sim-jitter-ms", type=float, default=1.0, help="link jitter in the simulation")
    ap.add_argument("--json", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results" / "bench_scaling.json")
    a = ap.parse_args()
    r = asyncio.run(main_async(a))
    print(f"# in-process scaling, compute {a.compute_ms:g} ms/bucket (awaited), batch {BATCH}/rank, "
          f"wall clock, median of {a.repeat}; load average {r['loadavg_1min'][0]:.1f} -> "
          f"{r['loadavg_1min'][1]:.1f} on {r['cpus']} cpus\n")
    print_tables(r["scaling"], r["straggler"], cpu=True)
    v = r["virtual"]
    print(f"\n# the same in virtual time (discrete-event simulation, {v['jitter_ms']:g} ms link jitter, "
          f"{v['seconds']:g} s)\n")
    print_tables(v["scaling"], v["straggler"], cpu=False)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
