"""Protocol overhead: rounds/s of a tiny model (8 parameters, batch 1, no compute time) with two
ranks, in process and per link kind, as a ratio to the raw round trip of the same link measured
in the same run.

Method. A round with two ranks needs at least one round trip leader -> follower -> leader
(the round out, the follower's bucket back), so ``round_ms / raw_rtt_ms`` is how many raw round
trips one protocol round costs (1.0 would be free protocol) and ``rounds/s / raw round
trips/s`` the fraction of the link's ping-pong rate the protocol keeps.

- in process: two RankMachines on the in-memory bus (MemoryNetwork, which encodes and decodes
  every message) in one asyncio loop; raw = a ``grad`` message ping-ponged on the same buses;
- ws-star, rtc-star, rtc-mesh: a real ``tabcohort serve`` on loopback per link kind and two
  processes of ``bench/linkproc.py``: ``rank`` (RankMachine + driver + bus) for the rounds, and
  ``raw`` for the round trip of a pre-encoded chunk ping-ponged on the same path with nothing of
  ours in between (bare aiohttp WebSockets through the relay; the aiortc channel to the server
  and its relay; the peer-to-peer aiortc channel). The raw round trip is measured before and
  after the rounds; its median over both is the reference.

Usage: PYTHONPATH=client_py:server python bench/bench_overhead.py [--seconds 4] [--pings 500]
       [--links ws-star,rtc-star,rtc-mesh]
Writes bench/results/bench_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "client_py")]

from linkproc import LINKS, Procs, percentile, samples, serve_args, wait_until  # noqa: E402

BUCKET_LEN = 8
BATCH = 1


async def in_process(seconds: float, pings: int) -> dict:
    from tabcohort.bus.memory import MemoryNetwork
    from tabcohort.model.toy import ToyWorker
    from tabcohort.protocol import RankMachine
    from tabcohort.runtime.driver import RankDriver
    from tabcohort.sched import AsyncioScheduler

    loop = asyncio.get_running_loop()
    # raw: a tiny grad ping-ponged between two in-memory buses
    net = MemoryNetwork(AsyncioScheduler(loop), seed=0, log=False)
    a, b = net.attach(1), net.attach(2)
    msg = {"t": "grad", "term": 1, "step": 1, "loss": 0.0, "samples": 1, "g": [0.0] * BUCKET_LEN}
    b.on_message = lambda m: b.post(dict(msg, to=1))
    fut: list[asyncio.Future] = []
    a.on_message = lambda m: fut[0].done() or fut[0].set_result(None)
    rtts = []
    for i in range(20 + pings):
        fut[:] = [loop.create_future()]
        t0 = time.perf_counter()
        a.post(dict(msg, to=2))
        await asyncio.wait_for(fut[0], 5)
        if i >= 20:
            rtts.append((time.perf_counter() - t0) * 1000.0)
    a.close()
    b.close()
    # rounds: two machines on a fresh network
    net = MemoryNetwork(AsyncioScheduler(loop), seed=0, log=False)
    drivers = []
    for k in (1, 2):
        w = ToyWorker(bucket_len=BUCKET_LEN, batch=BATCH)
        bus = net.attach(k)
        m = RankMachine(k, w, bus, job="bench", now_ms=RankDriver.clock_ms(loop), lr=0.01, eval_every=0)
        drivers.append(RankDriver(m, w, bus))
    for d in drivers:
        d.start()
    end = loop.time() + 30
    while not any(d.machine.looping and d.machine.policy.n == 2 and d.machine.step >= 10 for d in drivers):
        if loop.time() > end:
            raise TimeoutError("in-process cohort of 2 did not start rounds")
        await asyncio.sleep(0.01)
    lead = next(d.machine for d in drivers if d.machine.looping)
    s0, t0 = lead.step, loop.time()
    await asyncio.sleep(seconds)
    rounds_per_s = (lead.step - s0) / (loop.time() - t0)
    for d in drivers:
        await d.close()
    return {"link": "in-process", "rounds_per_s": rounds_per_s, "raw_rtt_ms_p50": statistics.median(rtts),
            "raw_rtt_ms_p99": percentile(rtts, 99), "raw_rtt_runs_ms_p50": [statistics.median(rtts)]}


def raw_rtt(url: str, link: str, pings: int, tmp: pathlib.Path, tag: str) -> dict:
    procs = Procs(tmp)
    out = tmp / f"raw-{link}-{tag}.json"
    try:
        procs.start("raw", "--url", url, "--link", link, "--role", "echo", "--out", str(out) + ".echo",
                    "--max-s", "120", log=f"raw-{link}-{tag}-echo.log")
        ready = pathlib.Path(str(out) + ".echo.ready")
        wait_until(ready.exists, 60, f"raw {link} echo ready", check=procs.check)
        # the pinger waits (bounded) for its peer itself
        p = procs.start("raw", "--url", url, "--link", link, "--role", "ping", "--count", str(pings),
                        "--out", str(out), "--max-s", "120", log=f"raw-{link}-{tag}-ping.log")
        wait_until(lambda: p.poll() is not None, 120, f"raw {link} ping-pong", check=procs.check)
        procs.check()
        return json.loads(out.read_text())
    finally:
        procs.stop()


def rounds(url: str, link: str, seconds: float, tmp: pathlib.Path) -> dict:
    procs = Procs(tmp)
    outs = [tmp / f"rounds-{link}-{k}.jsonl" for k in range(2)]
    try:
        for k, o in enumerate(outs):
            procs.start("rank", "--url", url, "--link", link, "--compute-ms", "0", "--bucket-len", str(BUCKET_LEN),
                        "--batch", str(BATCH), "--out", str(o), "--max-s", "120", log=f"rounds-{link}-{k}.log")

        def warm() -> bool:
            last = [ss[-1] if (ss := samples(o)) else None for o in outs]
            return all(s is not None and s["n"] == 2 for s in last) and any(s["leader"] and s["step"] >= 20 for s in last)
        wait_until(warm, 60, f"{link}: two ranks doing rounds", check=procs.check)
        t0 = time.time() + 0.1
        t1 = t0 + seconds
        wait_until(lambda: all((ss := samples(o)) and ss[-1]["t"] >= t1 for o in outs), seconds + 30,
                   f"{link}: the measurement window", check=procs.check)
        rate, links = 0.0, []
        for o in outs:
            ss = samples(o)
            s0 = next(s for s in ss if s["t"] >= t0)
            s1 = next(s for s in ss if s["t"] >= t1)
            if s1["leader"]:
                rate = (s1["step"] - s0["step"]) / (s1["t"] - s0["t"])
            links.append(s1["links"])
        return {"rounds_per_s": rate, "rank_links": links}
    finally:
        procs.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0, help="measurement window of the rounds")
    ap.add_argument("--pings", type=int, default=500, help="raw round trips per measurement")
    ap.add_argument("--links", default=",".join(LINKS))
    ap.add_argument("--json", type=pathlib.Path, default=HERE / "results" / "bench_overhead.json")
    a = ap.parse_args()
    from tests.integration.conftest import Cluster

    rows = [dict(asyncio.run(in_process(a.seconds, a.pings)), loadavg_1m=os.getloadavg()[0])]
    with tempfile.TemporaryDirectory() as d:
        for link in a.links.split(","):
            tmp = pathlib.Path(d) / link
            tmp.mkdir()
            c = Cluster(tmp)
            c.room = "bench"
            try:
                url = c.serve(*serve_args(link))
                ws = url.replace("http://", "ws://") + "/api/rooms/bench/ws"
                before = raw_rtt(ws, link, a.pings, tmp, "before")
                r = rounds(ws, link, a.seconds, tmp)
                after = raw_rtt(ws, link, a.pings, tmp, "after")
            finally:
                c.close()
            rtts = before["rtt_ms"] + after["rtt_ms"]
            rows.append({"link": link, **r, "loadavg_1m": os.getloadavg()[0], "raw_rtt_ms_p50": statistics.median(rtts),
                         "raw_rtt_ms_p99": percentile(rtts, 99),
                         "raw_rtt_runs_ms_p50": [statistics.median(before["rtt_ms"]), statistics.median(after["rtt_ms"])],
                         "raw_links": [before["links"], after["links"]]})
            print(f"  {link}: {r['rounds_per_s']:.0f} rounds/s, raw rtt {rows[-1]['raw_rtt_ms_p50']:.2f} ms",
                  file=sys.stderr, flush=True)
    for r in rows:
        r["round_ms"] = 1000.0 / r["rounds_per_s"] if r["rounds_per_s"] else float("inf")
        r["round_in_raw_rtts"] = r["round_ms"] / r["raw_rtt_ms_p50"]
        r["rounds_per_raw_rt_rate"] = 1.0 / r["round_in_raw_rtts"]
    print(f"# protocol overhead: 2 ranks, tiny model ({BUCKET_LEN} parameters, batch {BATCH}, no compute), "
          f"rounds vs the raw round trip of the same link, same run\n")
    print("| link | rounds/s | round ms | raw round trip ms (p50, before / after) | round = raw round trips | "
          "rounds/s ÷ raw round trips/s | load (1 min) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        runs = " / ".join(f"{x:.2f}" for x in r["raw_rtt_runs_ms_p50"])
        print(f"| {r['link']} | {r['rounds_per_s']:.0f} | {r['round_ms']:.2f} | {r['raw_rtt_ms_p50']:.3f} ({runs}) | "
              f"{r['round_in_raw_rtts']:.1f} | {r['rounds_per_raw_rt_rate'] * 100:.0f} % | {r['loadavg_1m']:.1f} |")
    odd = [r["link"] for r in rows if r["link"].startswith("rtc") and any(
        v != "rtc" for ln in r.get("rank_links", []) + r.get("raw_links", []) for v in ln.values())]
    if odd:
        print(f"\nWebRTC runs where a link used the WebSocket/relay instead: {odd}")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"bucket_len": BUCKET_LEN, "batch": BATCH, "seconds": a.seconds,
                                  "pings": a.pings, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
