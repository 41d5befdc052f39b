"""The protocol at 10, 100 and 1,000 ranks in one room, by discrete-event simulation
(``tabcohort.runtime.simscale``: the production rank machine on a virtual clock and the in-memory
bus; README "Scaling limits", docs/SCALING.md).

Per cohort size n: rounds/s in virtual time (bounded by the simulated compute: the in-memory bus
has no bandwidth, so what a real link adds shows in the bytes), beat messages each rank sends and
receives per second, bytes into the leader per round (every message kind, chunk headers included)
and the gradients behind them, beats one join costs (every member answers a ``hello`` with a
broadcast beat), and the time to re-elect after the leader is killed, with the room's server as
the witness of the link close (the star) and, where it is affordable to simulate, without one
(the mesh: the takeover waits ``policy(n).takeover_ms``); the policy's own figures beside them.

Writes ``bench/results/scale.json`` and prints Markdown tables.

Usage: PYTHONPATH=client_py python bench/bench_scale.py [--quick] [--ns 10,100,1000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "client_py"))

from tabcohort.protocol.policy import Timing, policy  # noqa: E402
from tabcohort.runtime.simscale import run_scale  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter windows, one kill (about 10 min on 2 cores)")
    ap.add_argument("--ns", default="10,100,1000", help="cohort sizes")
    ap.add_argument("--params", type=int, default=64, help="parameters of the toy model (float32)")
    ap.add_argument("--compute-ms", type=float, default=100.0, help="virtual compute per bucket, ms")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(HERE / "results" / "scale.json"))
    a = ap.parse_args(argv)
    ns = [int(x) for x in a.ns.split(",") if x.strip()]
    steady_ms = 3000.0 if a.quick else 10_000.0
    kills = 1 if a.quick else 2
    t = Timing()
    rows, nowit = [], []
    for n in ns:
        r = run_scale(n, params=a.params, seed=a.seed, steady_ms=steady_ms, joins=1 if a.quick else 2,
                      leaves=max(1, n // 10), kills=kills, witness=True, compute_ms=a.compute_ms,
                      settle=n <= 100, timing=t)
        rows.append(r.as_dict())
        print(f"# n={n}: simulated in {r.wall_s:.0f} s wall, {r.deliveries:,} deliveries", file=sys.stderr, flush=True)
        if n <= 10:   # without a witness the re-election waits policy.takeover: simulate where cheap
            w = run_scale(n, params=a.params, seed=a.seed, steady_ms=1000.0, joins=0, leaves=0, kills=1,
                          witness=False, compute_ms=a.compute_ms, settle=False, timing=t)
            nowit.append({"n": n, "reelect_ms": w.reelect_ms, "policy_takeover_ms": w.policy_takeover_ms})
    out = {"params": a.params, "compute_ms": a.compute_ms, "steady_ms": steady_ms, "timing": t.__dict__,
           "rows": rows, "no_witness": nowit}
    pathlib.Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(a.json).write_text(json.dumps(out, indent=2))

    print(f"*one room by discrete-event simulation (virtual time): toy model of {a.params} float32 parameters, "
          f"{a.compute_ms:g} ms of compute per bucket, global batch 2n, quorum rule; warm start (the n ranks "
          f"as a formed cohort), then a {steady_ms / 1000:g} s window, then churn: joins, n/10 leaves, "
          f"{kills} leader kill(s)*")
    print()
    print("| n | rounds/s (virtual) | beats sent / rank / s | beats received / rank / s | bytes into the leader "
          "/ round | grads into the leader / round | leader's frame bytes | beats per join | re-elect ms "
          "(server witness) | policy beat / takeover ms | one leader after churn | bit-identical at stop |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|:---:|")
    for r in rows:
        re = ", ".join(f"{x:.0f}" for x in r["reelect_ms"]) or "-"
        bit = {True: "yes", False: "NO", None: "not checked"}[r["bit_identical"]]
        print(f"| {r['n']} | {r['rounds_per_s']:.1f} | {r['beats_sent_per_rank_per_s']:.3f} | "
              f"{r['beats_received_per_rank_per_s']:.1f} | {r['bytes_into_leader_per_round']:,.0f} | "
              f"{r['grads_into_leader_per_round']:.0f} | {r['round_frame_bytes']:,.0f} | {r['beats_per_join']:,.0f} | "
              f"{re} | {r['policy_beat_ms']:,.0f} / {r['policy_takeover_ms']:,.0f} | "
              f"{'yes' if r['leaders_after_churn'] == 1 else 'NO'} | {bit} |")
    print()
    print("| n | re-elect ms without a witness (mesh) | policy takeover ms |")
    print("|---:|---:|---:|")
    for w in nowit:
        print(f"| {w['n']} | {', '.join(f'{x:.0f}' for x in w['reelect_ms'])} (simulated) | "
              f"{w['policy_takeover_ms']:,.0f} |")
    for n in ns:
        if n > 10:
            print(f"| {n} | not simulated (>= the takeover) | {policy(n, t).takeover_ms:,.0f} |")
    print()
    print(f"JSON: {os.path.relpath(a.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
