"""Rounds/s of a 4-rank in-process cohort with a tiny model: the unclamped yield between
rounds (``call_soon``, what the driver does) against a 4 ms timer yield (what a clamped browser
``setTimeout(0)`` gives after nesting). Both measured in the same run, interleaved, so the
ratio is meaningful on a shared, noisy machine (PROTOCOL.md, "The leader loop").

Usage: python bench/bench_yield.py [--seconds 3] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "client_py"))

from tabcohort.bus.memory import MemoryNetwork  # noqa: E402
from tabcohort.model.toy import ToyWorker  # noqa: E402
from tabcohort.protocol import RankMachine  # noqa: E402
from tabcohort.runtime.driver import RankDriver  # noqa: E402
from tabcohort.sched import AsyncioScheduler  # noqa: E402


async def rounds_per_s(yield_delay_ms: float, seconds: float, ranks: int = 4) -> float:
    loop = asyncio.get_running_loop()
    net = MemoryNetwork(AsyncioScheduler(loop), seed=0, log=False)
    drivers = []
    for k in range(1, ranks + 1):
        w = ToyWorker(bucket_len=8, batch=2)
        bus = net.attach(k)
        m = RankMachine(k, w, bus, job="bench", now_ms=RankDriver.clock_ms(loop), lr=0.01, ready=(k == 1))
        drivers.append(RankDriver(m, w, bus, yield_delay_ms=yield_delay_ms))
    for d in drivers:
        d.start()
    leader = drivers[0]
    # warm up until every rank is in the cohort
    for _ in range(400):
        await asyncio.sleep(0.01)
        if leader.machine.state(leader.now_ms())["cohort"] == ranks:
            break
    s0, t0 = leader.machine.step, loop.time()
    await asyncio.sleep(seconds)
    rate = (leader.machine.step - s0) / (loop.time() - t0)
    for d in drivers:
        await d.close()
    return rate


async def main_async(seconds: float, repeats: int) -> dict:
    soon, timer = [], []
    for _ in range(repeats):                     # interleaved: both see the same machine load
        soon.append(await rounds_per_s(0.0, seconds))
        timer.append(await rounds_per_s(4.0, seconds))
    return {"unclamped_rounds_per_s": statistics.median(soon), "timer4ms_rounds_per_s": statistics.median(timer),
            "ratio": statistics.median(soon) / statistics.median(timer), "repeats": repeats, "seconds": seconds,
            "ranks": 4, "model": "toy-lsq, 8 params"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=pathlib.Path, default=None)
    a = ap.parse_args()
    r = asyncio.run(main_async(a.seconds, a.repeats))
    print("| yield between rounds | rounds/s (median) | ratio |")
    print("|---|---:|---:|")
    print(f"| call_soon (unclamped) | {r['unclamped_rounds_per_s']:.0f} | {r['ratio']:.1f}x |")
    print(f"| 4 ms timer (clamped browser timer) | {r['timer4ms_rounds_per_s']:.0f} | 1.0x |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
