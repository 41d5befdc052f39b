"""Local steps (DiLoCo-style rounds) over a slow link: time to a target held-out accuracy and
bytes per applied sample for H in {1, 4, 16, 64} (docs/PROTOCOL.md, "Local steps and optimizer
state"; README "Local steps").

Four ranks of the digits MLP, then of a module job (default ``examples/jobs/cnn_digits.py``,
``--job``: any job whose worker runs local steps), in the seeded simulation (``tabcohort.runtime.sim``: the production
``RankMachine`` over the in-memory bus on a virtual clock). Every link (each direction of each
pair) has ``--bandwidth`` bytes/s and ``--delay-ms`` one-way latency (``MemoryNetwork`` knobs:
frames are serialised onto a link, so a round's parameters take ``size / bandwidth`` to leave);
then the same runs unthrottled. Compute takes virtual time: ``ms_per_sample`` x samples, with
``ms_per_sample`` measured on this machine at the start of the run (the numpy worker's gradient
over a share of ``global batch / 4`` samples), so compute and communication are in honest
proportion. Every rank's share is its quarter of the global batch, in every round (the
machine's equal-shares mode, ``global_batch=None``: with speed-planned shares the leader, whose
own bucket crosses no link, would be faster alone than any follower behind a 50 ms link). H = 1 is synchronous SGD at ``--lr``; H > 1 runs H inner SGD steps at ``--inner-lr``
and DiLoCo's outer Nesterov (lr 0.7, momentum 0.9). Each configuration runs until the target
accuracy is reached and the sample budget (``--epochs`` epoch-equivalents) is spent; the final
accuracy is taken at that budget. The leader evaluates held-out accuracy after every outer step.

Also measured: what carrying the optimizer state in every round costs (H = 16 with Nesterov,
whose momentum travels with each round, against H = 16 with a stateless SGD outer step).

Writes ``bench/results/local_steps.json`` and prints a Markdown table. Not part of CI.

Usage: PYTHONPATH=client_py python bench/bench_local_steps.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from typing import Any, Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "client_py"))

from tabcohort.jobs import load_job  # noqa: E402
from tabcohort.model import load_dataset, make_worker  # noqa: E402
from tabcohort.protocol.optim import TrainConfig  # noqa: E402
from tabcohort.runtime.sim import SimCohort  # noqa: E402

HS = (1, 4, 16, 64)
N_RANKS = 4


class Model:
    """What a run trains: ``make(batch)`` builds one rank's worker (same init on every rank)."""

    def __init__(self, key: str, title: str, make: Callable[[int], Any], train_len: int) -> None:
        self.key, self.title, self.make, self.train_len = key, title, make, train_len
        self.n_params = make(1).bucket_len


def mlp_model(hidden: tuple[int, ...], seed: int) -> Model:
    ds = load_dataset("digits", seed=seed)
    return Model("mlp", f"digits, MLP {hidden}",
                 lambda b: make_worker(ds, hidden=hidden, batch=b, seed=0, backend="auto"), ds.train_len)


def job_model(ref: str) -> Model:
    job = load_job(ref)
    n = int(job.data["x_train"].shape[0]) if "x_train" in job.data else 1000
    shown = os.path.relpath(ref, pathlib.Path(__file__).resolve().parents[1]) if os.path.isabs(ref) else ref
    return Model("job", f"the {job.name} job ({shown})",
                 lambda b: job.make_worker(batch=b, seed=0, backend="auto"), n)


def calibrate_ms_per_sample(model: Model, share: int) -> float:
    """Wall milliseconds per sample of one gradient over ``share`` samples (median of repeats)."""
    w = model.make(share)
    times = []
    for i in range(30):
        t0 = time.perf_counter()
        w.grads_sync(i * share, share)
        times.append((time.perf_counter() - t0) * 1000.0)
    times.sort()
    return times[len(times) // 2] / share


def run(model: Model, *, h: int, outer: str, throttled: bool, args: argparse.Namespace,
        ms_per_sample: float) -> dict:
    """One cohort run; returns the time to target, final accuracy and bytes per sample."""
    sim = SimCohort(seed=args.seed)
    if throttled:
        sim.network.set_default_link(delay_ms=args.delay_ms, bandwidth_bytes_per_s=args.bandwidth)
    if h == 1 and outer == "sgd":
        train, lr = TrainConfig(), args.lr
    else:
        train, lr = TrainConfig(local_steps=h, inner_lr=args.inner_lr, outer_optimizer=outer), args.outer_lr
    share = args.global_batch // N_RANKS
    beats = [{"t": "beat", "from": k, "batch": share, "ready": True, "running": True, "step": 0,
              "backend": "numpy", "term": 0} for k in range(1, N_RANKS + 1)]
    ranks = []
    for k in range(1, N_RANKS + 1):
        # equal shares of a quarter of the global batch each (RankMachine(global_batch=None):
        # every rank's share is its cap), so the four ranks are one data-parallel cohort; with
        # speed-planned shares a leader whose own bucket needs no round trip is faster alone
        # than any follower behind a 50 ms link, and it would train alone
        w = model.make(share)
        ranks.append(sim.add(k, w, compute_ms=0.0, ms_per_sample=ms_per_sample, lr=lr, eval_every=1,
                             global_batch=None, train=train, ready=True, start=False))
    # a cohort that has formed, so the time measured is training, not joining: every rank ready
    # from the same init, past its first heartbeat (its policy is that of 4 ranks: a quorum of 3)
    # and with every other rank in its roster, ready and running
    for r in ranks:
        for b in beats:
            if b["from"] != r.id:
                r.machine.handle(b, now_ms=sim.now_ms())
    sim.run_until(sim.now_ms() + 2 * sim.timing.beat_ms)
    for r in ranks:
        for b in beats:
            if b["from"] != r.id:
                r.machine.handle(b, now_ms=sim.now_ms())
        r.machine.drain()
    t_start = sim.now_ms()
    for r in ranks[1:] + ranks[:1]:      # rank 1, the lowest id, last: it leads the formed cohort
        r.start()
    budget = args.epochs * model.train_len
    t_target = None
    wall0 = time.perf_counter()
    lead = None
    while True:
        sim.run_until(sim.now_ms() + args.tick_ms)
        lead = next((r for r in sim.alive() if r.machine.is_leader(sim.now_ms())), lead)
        if lead is None:
            continue
        m = lead.machine
        applied = sum(m.applied_by.values())
        if t_target is None and m.accuracy is not None and m.accuracy >= args.target:
            t_target = sim.now_ms() - t_start
        if applied >= budget and (t_target is not None or applied >= 3 * budget):
            break
        if time.perf_counter() - wall0 > args.max_wall_s:
            break
    m = lead.machine
    applied = sum(m.applied_by.values())
    sent = sum(lb.sent for r in sim.ranks.values() for lb in r.bus.bytes().values())
    return {"h": h, "outer": outer, "throttled": throttled, "steps": m.step,
            "time_to_target_s": None if t_target is None else round(t_target / 1000.0, 3),
            "final_accuracy": round(float(lead.worker.evaluate()), 4), "samples_applied": applied,
            "virtual_s": round((sim.now_ms() - t_start) / 1000.0, 3), "bytes_sent": sent,
            "bytes_per_sample": round(sent / max(1, applied), 1),
            "wall_s": round(time.perf_counter() - wall0, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller model and budget (under 2 minutes)")
    ap.add_argument("--bandwidth", type=float, default=2e6, help="bytes/s per link (default 2 MB/s)")
    ap.add_argument("--delay-ms", type=float, default=50.0, help="one-way link delay, ms")
    ap.add_argument("--hidden", default=None, help="hidden widths, e.g. 256,256 (default: 256,256; quick: 128)")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.5, help="H = 1: synchronous SGD learning rate")
    ap.add_argument("--inner-lr", type=float, default=0.1, help="H > 1: inner SGD learning rate")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="H > 1: outer learning rate")
    ap.add_argument("--target", type=float, default=0.95, help="target held-out accuracy")
    ap.add_argument("--epochs", type=float, default=None, help="sample budget in epoch-equivalents "
                    "(default 40; quick 20)")
    ap.add_argument("--tick-ms", type=float, default=1.0, help="virtual time between accuracy checks, ms")
    ap.add_argument("--max-wall-s", type=float, default=120.0, help="wall bound of one configuration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default="mlp,job", help="what to train: mlp (the digits MLP), job (--job)")
    ap.add_argument("--job", default=str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "jobs" / "cnn_digits.py"),
                    help="the module job of the 'job' model (default: examples/jobs/cnn_digits.py)")
    ap.add_argument("--json", default=str(pathlib.Path(__file__).parent / "results" / "local_steps.json"))
    args = ap.parse_args()
    if args.hidden is None:
        args.hidden = "128" if args.quick else "256,256"
    args.hidden = tuple(int(x) for x in args.hidden.split(",") if x)
    if args.epochs is None:
        args.epochs = 20.0 if args.quick else 40.0
    if args.quick:
        args.max_wall_s = min(args.max_wall_s, 10.0)
    t0 = time.perf_counter()
    models = []
    for key in args.models.split(","):
        if key == "mlp":
            models.append(mlp_model(args.hidden, args.seed))
        elif key == "job":
            models.append(job_model(args.job))
        else:
            ap.error(f"--models: unknown model {key!r} (mlp, job)")
    out = {"models": {}, "config": {"ranks": N_RANKS, "global_batch": args.global_batch,
                                     "bandwidth_bytes_per_s": args.bandwidth, "delay_ms": args.delay_ms,
                                     "target_accuracy": args.target, "epochs_budget": args.epochs,
                                     "lr": args.lr, "inner_lr": args.inner_lr, "outer_lr": args.outer_lr,
                                     "quick": args.quick}}
    for model in models:
        out["models"][model.key] = bench_model(model, args)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    path = pathlib.Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path} in {out['wall_s']} s")
    return 0


def bench_model(model: Model, args: argparse.Namespace) -> dict:
    """Every H throttled and unthrottled, and the state's cost, for one model; prints its table."""
    share = args.global_batch // N_RANKS
    ms = calibrate_ms_per_sample(model, share)
    n_params = model.n_params
    print(f"{model.title}, {n_params} parameters ({4 * n_params / 1e6:.3f} MB at f32), "
          f"{N_RANKS} ranks, global batch {args.global_batch}; compute {ms * 1000:.1f} us/sample "
          f"(measured); link {args.bandwidth / 1e6:g} MB/s + {args.delay_ms:g} ms", flush=True)
    rows = []
    for throttled in (True, False):
        for h in HS:
            r = run(model, h=h, outer="sgd" if h == 1 else "nesterov", throttled=throttled, args=args,
                    ms_per_sample=ms)
            rows.append(r)
            print(json.dumps(r), flush=True)
    # the cost of the optimizer state in every round: H = 16, Nesterov against stateless SGD
    state_rows = [next(r for r in rows if r["h"] == 16 and r["throttled"]),
                  run(model, h=16, outer="sgd", throttled=True, args=args, ms_per_sample=ms)]
    print(json.dumps(state_rows[1]), flush=True)

    def ratios(throttled: bool) -> dict:
        sel = {r["h"]: r for r in rows if r["throttled"] == throttled}
        base = sel[1]
        out = {}
        for h, r in sel.items():
            t, t1 = r["time_to_target_s"], base["time_to_target_s"]
            out[str(h)] = {"speedup_to_target": None if not t or not t1 else round(t1 / t, 2),
                           "bytes_per_sample_ratio": round(base["bytes_per_sample"] / r["bytes_per_sample"], 2),
                           "final_accuracy_delta": round(r["final_accuracy"] - base["final_accuracy"], 4)}
        return out
    result = {
        "model": model.title, "n_params": n_params, "ms_per_sample": ms,
        "rows": rows, "ratios_throttled": ratios(True), "ratios_unthrottled": ratios(False),
        "state_cost": {"nesterov_bytes_per_sample": state_rows[0]["bytes_per_sample"],
                       "sgd_outer_bytes_per_sample": state_rows[1]["bytes_per_sample"],
                       "ratio": round(state_rows[0]["bytes_per_sample"] / state_rows[1]["bytes_per_sample"], 3)},
    }
    print(f"\n{model.title}:\n")
    print("| link | H | outer | time to target (s) | speedup | final acc | bytes/sample | bytes ratio |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        rt = result["ratios_throttled" if r["throttled"] else "ratios_unthrottled"][str(r["h"])]
        link = f"{args.bandwidth / 1e6:g} MB/s + {args.delay_ms:g} ms" if r["throttled"] else "unthrottled"
        tt = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.3f}"
        print(f"| {link} | {r['h']} | {r['outer']} | {tt} | {rt['speedup_to_target']} | "
              f"{r['final_accuracy'] * 100:.2f} % | {r['bytes_per_sample']:.0f} | {rt['bytes_per_sample_ratio']} |")
    sc = result["state_cost"]
    print(f"\nstate in every round (H = 16): Nesterov {sc['nesterov_bytes_per_sample']:.0f} B/sample vs "
          f"SGD outer {sc['sgd_outer_bytes_per_sample']:.0f} B/sample (x{sc['ratio']})\n")
    return result


if __name__ == "__main__":
    sys.exit(main())
