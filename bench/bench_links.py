"""Scaling over real links: N = 1, 2, 4 rank *processes* per link kind (ws-star, rtc-star,
rtc-mesh) against a real ``tabcohort serve`` on loopback, for the PROTOCOL.md quorum rule and
our grace rule (docs/PROTOCOL-NOTES.md), side by side in one run.

Method. One server per link kind (``serve --dataset synthetic``; ``--rtc-hosts 127.0.0.1`` for
the WebRTC star, ``--topology mesh`` for the mesh). For each N and rule (rules interleaved per
N) it starts N processes of ``bench/linkproc.py rank``: a real RankMachine, the real asyncio
driver and the real bus, with a ToyWorker (64 parameters, batch 8) whose bucket takes
``--compute-ms`` of *awaited* time, so two cores do not limit scaling. Each process appends a
sample (wall time, step, buckets reduced, buckets computed, cohort size, links) every 50 ms.
After warm-up (every process sees a cohort of N and the leader has done 10 rounds) it measures
``--seconds`` and derives, from the samples at the window's ends: rounds/s, samples computed/s
(every bucket computed), samples applied/s (buckets that entered a reduce) and the applied
efficiency ``applied/s(N) / (N * applied/s(1))`` against N = 1 of the same link (N = 1 collects
from nobody, so the rules cannot differ there: the mean of its two runs is the base of both).
Leader changes inside the window are counted (should be 0). Links actually used are recorded
(a WebRTC pair that fell back to the relay would show here).

Usage: PYTHONPATH=client_py:server python bench/bench_links.py [--seconds 5] [--compute-ms 50]
       [--ns 1,2,4] [--links ws-star,rtc-star,rtc-mesh] [--rules quorum,grace]
Writes bench/results/bench_links.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from linkproc import LINKS, Procs, samples, serve_args, wait_until  # noqa: E402

BATCH = 8


def _at(ss: list[dict], t: float) -> dict | None:
    """The first sample at or after wall time ``t``."""
    return next((s for s in ss if s["t"] >= t), None)


def run(url: str, link: str, n: int, rule: str, a: argparse.Namespace, tmp: pathlib.Path) -> dict:
    procs = Procs(tmp)
    outs = [tmp / f"{link}-{n}-{rule}-{k}.jsonl" for k in range(n)]
    try:
        for k, out in enumerate(outs):
            procs.start("rank", "--url", url, "--link", link, "--rule", rule, "--compute-ms", str(a.compute_ms),
                        "--batch", str(BATCH), "--out", str(out), "--max-s", "120",
                        log=f"{link}-{n}-{rule}-{k}.log")

        def warm() -> bool:
            last = [ss[-1] if (ss := samples(o)) else None for o in outs]
            if any(s is None or s["n"] != n or s["cohort"] != n for s in last):
                return False
            return any(s["leader"] and s["step"] >= 10 for s in last)
        t_warm0 = time.monotonic()
        wait_until(warm, 60, f"{link} N={n} {rule}: a cohort of {n} doing rounds", check=procs.check)
        warmup_s = time.monotonic() - t_warm0
        t0 = time.time() + 0.1
        t1 = t0 + a.seconds
        wait_until(lambda: all((ss := samples(o)) and ss[-1]["t"] >= t1 for o in outs), a.seconds + 30,
                   f"{link} N={n} {rule}: the measurement window", check=procs.check)
        rounds = computed = applied = 0.0
        leaders, takeovers, links, cohort_min = set(), 0, [], n
        for o in outs:
            ss = samples(o)
            s0, s1 = _at(ss, t0), _at(ss, t1)
            dt = s1["t"] - s0["t"]
            computed += (s1["calls"] - s0["calls"]) * BATCH / dt
            applied += (s1["reduced"] - s0["reduced"]) * BATCH / dt
            win = [s for s in ss if s0["t"] <= s["t"] <= s1["t"]]
            leaders |= {s["id"] for s in win if s["leader"]}
            cohort_min = min([cohort_min] + [s["cohort"] for s in win])
            takeovers += s1["takeovers"] - s0["takeovers"]
            if s1["leader"]:
                rounds = (s1["step"] - s0["step"]) / dt
            links.append(s1["links"])
        return {"link": link, "n": n, "rule": rule, "rounds_per_s": rounds, "computed_per_s": computed,
                "applied_per_s": applied, "leaders_in_window": len(leaders), "takeovers_in_window": takeovers,
                "cohort_min": cohort_min, "warmup_s": warmup_s, "links": links, "loadavg_1m": os.getloadavg()[0]}
    finally:
        procs.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="measurement window per run")
    ap.add_argument("--compute-ms", type=float, default=50.0, help="awaited compute per bucket")
    ap.add_argument("--ns", default="1,2,4")
    ap.add_argument("--links", default=",".join(LINKS))
    ap.add_argument("--rules", default="quorum,grace")
    ap.add_argument("--json", type=pathlib.Path, default=HERE / "results" / "bench_links.json")
    a = ap.parse_args()
    from tests.integration.conftest import Cluster

    ns = [int(x) for x in a.ns.split(",")]
    rules = a.rules.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for link in a.links.split(","):
            tmp = pathlib.Path(d) / link
            tmp.mkdir()
            c = Cluster(tmp)
            c.room = "bench"
            try:
                url = c.serve(*serve_args(link))
                ws = url.replace("http://", "ws://") + "/api/rooms/bench/ws"
                for n in ns:
                    for rule in rules:
                        r = run(ws, link, n, rule, a, tmp)
                        rows.append(r)
                        print(f"  {link} N={n} {rule}: {r['rounds_per_s']:.1f} rounds/s, applied "
                              f"{r['applied_per_s']:.0f}/s (warm-up {r['warmup_s']:.1f} s)", file=sys.stderr, flush=True)
            finally:
                c.close()
    # N = 1 runs no collection, so both rules behave alike there: their mean is the base of both
    # (one noisy N = 1 run would otherwise skew one rule's whole column)
    for r in rows:
        ones = [x["applied_per_s"] for x in rows if x["link"] == r["link"] and x["n"] == 1]
        base = sum(ones) / len(ones) if ones else None
        r["applied_per_s_base"] = base
        r["applied_efficiency"] = r["applied_per_s"] / (r["n"] * base) if base else None
    out = {"compute_ms": a.compute_ms, "seconds": a.seconds, "batch": BATCH, "runs": rows}
    print(f"# scaling over real links: rank processes + `tabcohort serve` on loopback, compute "
          f"{a.compute_ms:g} ms/bucket (awaited), batch {BATCH}/rank, {a.seconds:g} s windows\n")
    print("| link | N | rule | rounds/s | computed samples/s | applied samples/s | applied efficiency |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for x in rows:
        eff = "n/a" if x["applied_efficiency"] is None else f"{x['applied_efficiency'] * 100:.0f} %"
        note = "" if x["leaders_in_window"] <= 1 else f" ({x['leaders_in_window']} leaders)"
        print(f"| {x['link']} | {x['n']} | {x['rule']} | {x['rounds_per_s']:.1f} | {x['computed_per_s']:.0f} | "
              f"{x['applied_per_s']:.0f} | {eff}{note} |")
    loads = [x["loadavg_1m"] for x in rows]
    print(f"\nLoad average (1 min) during the runs: {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} CPUs.")
    fell_back = [(x["link"], x["n"], x["rule"]) for x in rows if x["link"] != "ws-star"
                 and any(v != "rtc" for ln in x["links"] for v in ln.values())]
    if fell_back:
        print(f"\nWebRTC links that used the relay instead: {fell_back}")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
