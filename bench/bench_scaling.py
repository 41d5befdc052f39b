"""Scaling of an in-process cohort with a simulated compute time per bucket, for the
PROTOCOL.md quorum rule and our grace rule (docs/PROTOCOL-NOTES.md), side by side in one run.

Each rank's bucket takes ``--compute-ms`` of *awaited* time (not CPU), so two cores do not
limit scaling. Reported per N: rounds/s, samples computed/s (every bucket computed), samples
applied/s (buckets that entered a reduce), and applied efficiency
``applied/s(N) / (N * applied/s(1))``. Then the straggler check: one rank 10x slower, round
rate relative to the same cohort without it.

Usage: python bench/bench_scaling.py [--seconds 4] [--compute-ms 50] [--ns 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "client_py"))

from tabcohort.bus.memory import MemoryNetwork  # noqa: E402
from tabcohort.model.toy import ToyWorker  # noqa: E402
from tabcohort.protocol import RankMachine  # noqa: E402
from tabcohort.runtime.driver import RankDriver  # noqa: E402
from tabcohort.sched import AsyncioScheduler  # noqa: E402

BATCH = 8


async def run(n: int, rule: str, seconds: float, compute_ms: float, slow: int = 0) -> dict:
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
    s0, b0 = lead.step, lead.counters["buckets_reduced"]
    c0 = sum(d.worker.calls for d in drivers)
    t0 = loop.time()
    await asyncio.sleep(seconds)
    dt = loop.time() - t0
    rounds = lead.step - s0
    applied = (lead.counters["buckets_reduced"] - b0) * BATCH
    computed = (sum(d.worker.calls for d in drivers) - c0) * BATCH
    for d in drivers:
        await d.close()
    return {"n": n, "rule": rule, "slow": slow, "rounds_per_s": rounds / dt,
            "computed_per_s": computed / dt, "applied_per_s": applied / dt}


async def main_async(a) -> dict:
    ns = [int(x) for x in a.ns.split(",")]
    rows = []
    for n in ns:
        for rule in ("quorum", "grace"):                     # interleaved per N
            rows.append(await run(n, rule, a.seconds, a.compute_ms))
    base = {r["rule"]: r["applied_per_s"] for r in rows if r["n"] == 1}
    for r in rows:
        r["applied_efficiency"] = r["applied_per_s"] / (r["n"] * base[r["rule"]])
    strag = []
    for n in (4, 8):
        for rule in ("quorum", "grace"):
            fast = await run(n, rule, a.seconds, a.compute_ms)
            slow = await run(n, rule, a.seconds, a.compute_ms, slow=1)
            strag.append({"n": n, "rule": rule, "rounds_per_s": fast["rounds_per_s"],
                          "rounds_per_s_with_straggler": slow["rounds_per_s"],
                          "ratio": slow["rounds_per_s"] / fast["rounds_per_s"]})
    return {"compute_ms": a.compute_ms, "seconds": a.seconds, "batch": BATCH, "scaling": rows, "straggler": strag}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--compute-ms", type=float, default=50.0)
    ap.add_argument("--ns", default="1,2,4,8,16")
    ap.add_argument("--json", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results" / "bench_scaling.json")
    a = ap.parse_args()
    r = asyncio.run(main_async(a))
    print(f"# in-process scaling, compute {a.compute_ms:g} ms/bucket (awaited), batch {BATCH}/rank\n")
    print("| N | rule | rounds/s | computed samples/s | applied samples/s | applied efficiency |")
    print("|---:|---|---:|---:|---:|---:|")
    for x in r["scaling"]:
        print(f"| {x['n']} | {x['rule']} | {x['rounds_per_s']:.1f} | {x['computed_per_s']:.0f} | "
              f"{x['applied_per_s']:.0f} | {x['applied_efficiency'] * 100:.0f} % |")
    print("\n| N | rule | rounds/s | rounds/s, one rank 10x slower | ratio |")
    print("|---:|---|---:|---:|---:|")
    for x in r["straggler"]:
        print(f"| {x['n']} | {x['rule']} | {x['rounds_per_s']:.1f} | {x['rounds_per_s_with_straggler']:.1f} | "
              f"{x['ratio'] * 100:.0f} % |")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
