"""Local steps over the real relay with shaped links: a real ``tabcohort serve`` and four real
``tabcohort rank`` processes, each rank reaching the server through its own shaped TCP link
(bench/throttle.py: ``--bandwidth`` bytes/s and ``--delay-ms`` each way, the knob the simulator's
links have), for H in {1, 4, 16} (docs/PROTOCOL.md, "Local steps and optimizer state").

The room trains the digits MLP with a global batch of 64 and a cap of 16 samples per rank, so
every round needs all four ranks (a leader with no link in front of its own bucket would
otherwise cover the round alone). H = 1 is synchronous SGD at ``--lr``; H > 1 runs H inner SGD
steps at ``--inner-lr`` and DiLoCo's outer Nesterov (lr 0.7, momentum 0.9). Three ranks join
without the trainer credential (they may only contribute, so nothing trains yet), then the one
rank that may lead. Once the leader gives every rank its cap (the newcomers measured: their
first shares are probes, docs/PROTOCOL.md "Shares"), a window of ``--window-s`` measures the
applied samples per second (the leader's report) and the bytes the four links carried per
applied sample (both directions; ``--no-direct``, so every frame crosses the relay), and the
rounds in it that covered less than the global batch (0 expected). Each H's figure is a ratio
to H = 1 of the same run: applied samples/s is the speed of training per epoch; what H costs in
accuracy per sample is bench_local_steps.py's figure.

The relay cost is real here (the server's relay, WebSocket framing, TCP), and so is compute (the
ranks' processes share this machine's cores). Not part of CI (about 1-2 minutes).

Usage: python bench/bench_local_steps_relay.py [--hs 1,4,16] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any

import aiohttp

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from throttle import shaped_links  # noqa: E402

ROOM = "bench"
OPERATOR = "bench-operator-token-0123456789"
TRAINER = "bench-trainer-token-0123456789"
N_RANKS = 4


def _env(trainer: bool) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("TABCOHORT_")}
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "client_py"), str(ROOT / "server"), e.get("PYTHONPATH", "")])
    e["PYTHONUNBUFFERED"] = "1"
    if trainer:
        e["TABCOHORT_TRAINER_TOKEN"] = TRAINER
    return e


async def _spawn(args: list[str], log: pathlib.Path, *, trainer: bool = False) -> asyncio.subprocess.Process:
    fh = open(log, "wb")
    return await asyncio.create_subprocess_exec(sys.executable, "-m", "tabcohort", *args, stdout=fh,
                                                stderr=asyncio.subprocess.STDOUT, env=_env(trainer), cwd=str(ROOT))


async def _url_of(log: pathlib.Path, proc: asyncio.subprocess.Process, timeout_s: float = 30.0) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("URL "):
                return line.split()[1]
        if proc.returncode is not None:
            raise RuntimeError("serve exited:\n" + log.read_text(errors="replace")[-2000:])
        await asyncio.sleep(0.1)
    raise TimeoutError("no server URL within 30 s")


async def run(h: int, a: argparse.Namespace, tmp: pathlib.Path) -> dict:
    train = (["--lr", str(a.lr)] if h == 1 else
             ["--local-steps", str(h), "--inner-lr", str(a.inner_lr), "--outer-optimizer", "nesterov",
              "--outer-lr", str(a.outer_lr)])
    slog = tmp / f"serve-h{h}.log"
    serve = await _spawn(["serve", "--port", "0", "--room", ROOM, "--dataset", "digits", "--hidden", a.hidden,
                          "--global-batch", str(a.global_batch), "--batch", str(a.global_batch // N_RANKS),
                          "--report-interval", "0.25", "--operator-token", OPERATOR, "--trainer-token", TRAINER,
                          *train], slog)
    procs = [serve]
    links = []
    try:
        url = await _url_of(slog, serve)
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        links = await shaped_links((host, int(port)), N_RANKS, rate_bytes_per_s=a.bandwidth, delay_ms=a.delay_ms)
        auth = {"Authorization": f"Bearer {OPERATOR}"}
        async with aiohttp.ClientSession(headers=auth) as http:
            async def state() -> dict:
                async with http.get(f"{url}/api/rooms/{ROOM}") as r:
                    return await r.json()

            def rank(k: int, trainer: bool) -> Any:
                # --no-direct: every frame through the relay (native ranks would pair up on TCP)
                return _spawn(["rank", "--server", f"http://127.0.0.1:{links[k].port}", "--room", ROOM,
                               "--no-direct", "--print-every", "30"], tmp / f"rank-h{h}-{k}.log", trainer=trainer)
            # three contributors first (no trainer token: they may not lead, so nothing trains),
            # then the one rank that may lead: training starts with all four in the room
            for k in range(N_RANKS - 1):
                procs.append(await rank(k, False))
            end = time.monotonic() + 60
            while sum(1 for r in (await state())["ranks"] if r.get("connected") and r.get("report")) < N_RANKS - 1:
                if time.monotonic() > end:
                    raise TimeoutError(f"the contributors did not connect within 60 s: see {tmp}")
                await asyncio.sleep(0.1)
            procs.append(await rank(N_RANKS - 1, True))
            # the cohort formed and measured: the leader's round gives each rank its cap (a
            # newcomer's first share is a probe, not awaited, so the first rounds are smaller:
            # docs/PROTOCOL.md "Shares")
            def lead_of(st: dict) -> dict | None:
                return next((r["report"] for r in st["ranks"]
                             if r.get("report") and r["report"].get("is_leader")), None)
            cap = a.global_batch // N_RANKS
            end = time.monotonic() + 90
            while True:
                for p in procs:
                    if p.returncode is not None:
                        raise RuntimeError(f"a process exited {p.returncode}: see {tmp}")
                lead = lead_of(await state())
                if lead and len(lead.get("shares") or {}) == N_RANKS and set(lead["shares"].values()) == {cap}:
                    break
                if time.monotonic() > end:
                    raise TimeoutError(f"H = {h}: the four ranks were not all given their cap within 90 s "
                                       f"(last shares {lead and lead.get('shares')}); see {tmp}")
                await asyncio.sleep(0.1)
            formed_step = lead["step"]
            # the window: applied samples and link bytes over --window-s (polled reports, 0.25 s apart)
            t0, n0 = time.monotonic(), sum(lead["applied"].values())
            short0 = lead["counters"].get("rounds_below_global_batch", 0)
            b0 = sum(x.carried_bytes for x in links)
            await asyncio.sleep(a.window_s)          # (the measurement window itself)
            lead = lead_of(await state())
            dt = time.monotonic() - t0
            n1, b1 = sum(lead["applied"].values()), sum(x.carried_bytes for x in links)
            return {"h": h, "samples_per_s": round((n1 - n0) / dt, 1), "window_s": round(dt, 2),
                    "bytes_per_sample": round((b1 - b0) / max(1, n1 - n0), 1),
                    "rounds_per_s": None if lead is None else round((lead["step"] - formed_step) / dt, 2),
                    "short_rounds_in_window": lead["counters"].get("rounds_below_global_batch", 0) - short0,
                    "accuracy": lead.get("accuracy"), "loadavg_1m": os.getloadavg()[0]}
    finally:
        for p in procs[::-1]:
            if p.returncode is None:
                p.terminate()
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), 10)
            except asyncio.TimeoutError:
                p.kill()
                await p.wait()
        for x in links:
            await x.close()


async def amain(a: argparse.Namespace) -> dict:
    hs = [int(x) for x in a.hs.split(",")]
    if 1 not in hs:
        hs = [1] + hs
    rows = []
    tmp = tempfile.mkdtemp(prefix="bench-ls-relay-")   # (the processes' logs, kept on failure)
    for h in hs:
        r = await run(h, a, pathlib.Path(tmp))
        print(json.dumps(r), flush=True)
        rows.append(r)
    if not os.environ.get("BENCH_KEEP"):
        shutil.rmtree(tmp, ignore_errors=True)
    base = rows[0]
    for r in rows:
        r["speedup"] = round(r["samples_per_s"] / base["samples_per_s"], 2) if base["samples_per_s"] else None
        r["bytes_per_sample_ratio"] = (round(base["bytes_per_sample"] / r["bytes_per_sample"], 2)
                                       if r["bytes_per_sample"] else None)
    return {"config": {"ranks": N_RANKS, "hidden": a.hidden, "global_batch": a.global_batch,
                       "bandwidth_bytes_per_s": a.bandwidth, "delay_ms": a.delay_ms, "window_s": a.window_s},
            "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hs", default="1,4,16", help="the H values (1 is always run: the base)")
    ap.add_argument("--bandwidth", type=float, default=2e6, help="bytes/s each way per link (default 2 MB/s)")
    ap.add_argument("--delay-ms", type=float, default=50.0, help="one-way delay per link, ms")
    ap.add_argument("--hidden", default="128")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--inner-lr", type=float, default=0.1)
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--window-s", type=float, default=10.0, help="the measurement window, s")
    ap.add_argument("--json", default=str(HERE / "results" / "local_steps_relay.json"))
    a = ap.parse_args()
    t0 = time.perf_counter()
    out = asyncio.run(amain(a))
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    path = pathlib.Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    c = out["config"]
    print(f"\nthe digits MLP ({c['hidden']}), {N_RANKS} real ranks through the real relay, each on a shaped link "
          f"of {a.bandwidth / 1e6:g} MB/s + {a.delay_ms:g} ms each way; {a.window_s:g} s window after the cohort formed\n")
    print("| H | outer | applied samples/s | speedup | rounds/s | link bytes/sample | bytes ratio | short rounds |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in out["rows"]:
        print(f"| {r['h']} | {'sgd' if r['h'] == 1 else 'nesterov'} | {r['samples_per_s']:.0f} | {r['speedup']} | "
              f"{r['rounds_per_s']} | {r['bytes_per_sample']:.0f} | {r['bytes_per_sample_ratio']} | "
              f"{r['short_rounds_in_window']} |")
    print(f"\nwrote {path} in {out['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
