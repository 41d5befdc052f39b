"""Shared by the hostile-rank tests: one room trained to a fixed step by three honest native ranks
(with the trainer credential), with or without a hostile rank process (``hostile_rank.py``)."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import time
import urllib.request
from typing import Any, Callable

from .conftest import ROOT, Cluster, _env, wait_for

#: long enough that an attacker started after the first checkpoint acts while the cohort trains
#: (every attack showed by step 217-734 with a busy core beside the test, against the tests' bound
#: of 0.75 * STEPS), and the digits model converges (a global batch of 256 makes 2,500 steps
#: more than 350 passes over the 1,797 digits); 10,000 steps cost the integration tier 450 s
#: of its 1,250 on this 2-core machine, 4,000 about 450 s of its two workers' 2,050
STEPS = 2500
# An attack that stalls the room took it from ~850-1,400 to 0.13-0.47 rounds/s (1,800-10,000x); an
# attacked run must keep at least this fraction of the clean run's rate. Loose on purpose: the two
# runs are timed one after the other on a shared machine (a 3.4x dip of an attacked run alone was
# seen in CI with every drop counter as usual).
MIN_RATE_RATIO = 0.1
#: a global batch of four ranks' caps (64 samples each, ``--batch``): no rank can cover a round
#: alone, so every rank, the attacker too, is given a share once measured (with one rank's batch
#: as the global batch, a fast leader on loopback computes every round itself and an attacker is
#: only ever probed, harmless and unseen; PROTOCOL.md, "Shares")
SERVE_ARGS = ("--steps", str(STEPS), "--batch", "64", "--global-batch", "256", "--checkpoint-interval", "0.5",
              "--report-interval", "0.25")


class HostileProc:
    """``tests/integration/hostile_rank.py`` as a subprocess; its results in a JSON-lines file."""

    def __init__(self, cluster: Cluster, attacks: str, *, seconds: float = 90.0, seed: int = 0,
                 extra: tuple[str, ...] = ()) -> None:
        self.out = cluster.tmp / f"hostile-{attacks.replace(',', '+')}.jsonl"
        self.log = cluster.tmp / f"hostile-{attacks.replace(',', '+')}.log"
        self.fh = open(self.log, "wb")
        self.p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "integration" / "hostile_rank.py"),
                                   "--server", cluster.url, "--room", cluster.room, "--attack", attacks,
                                   "--seconds", str(seconds), "--seed", str(seed), "--out", str(self.out), *extra],
                                  stdout=self.fh, stderr=subprocess.STDOUT, env=_env(), cwd=str(ROOT))

    def events(self) -> list[dict]:
        try:
            return [json.loads(x) for x in self.out.read_text().splitlines() if x.strip()]
        except FileNotFoundError:
            return []

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)
        self.fh.close()


def metrics(cluster: Cluster) -> str:
    req = urllib.request.Request(f"{cluster.url}/metrics",
                                 headers={"Authorization": f"Bearer {cluster.operator_token}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels: str) -> float | None:
    """One sample's value from Prometheus text (labels in any order), or None."""
    for line in text.splitlines():
        m = re.match(rf"{re.escape(name)}\{{([^}}]*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return None


def train(cluster: Cluster, ckdir: pathlib.Path, *, attacks: str | None = None,
          visible: Callable[[dict], Any] | None = None, serve_extra: tuple[str, ...] = (),
          hostile_extra: tuple[str, ...] = (), seed: int = 0, wait_s: float = 240.0) -> dict:
    """Serve the digits room to ``STEPS`` with three honest ranks; with ``attacks``, start a
    hostile rank once the first checkpoint is stored and wait (while the cohort still trains)
    until ``visible(state)`` says the attack shows. Returns what the tests compare."""
    cluster.serve("--checkpoint-dir", str(ckdir), *SERVE_ARGS, *serve_extra)
    t0 = time.monotonic()
    ranks = [cluster.rank() for _ in range(3)]
    out: dict[str, Any] = {"hostile": None, "before": None}
    h = None
    try:
        first = wait_for(lambda: (s := cluster.state())["step"] > 0 and s, 90, "training to start")
        mark = (time.monotonic(), first["step"])     # (time, step) the training rate is taken from
        out["seen"] = first
        if attacks:
            ck = wait_for(lambda: (s := cluster.state())["checkpoints"] and s, 90, "a first checkpoint")
            out["before"] = max(c["accuracy"] for c in ck["checkpoints"])
            out["before_step"] = ck["step"]
            h = out["hostile"] = HostileProc(cluster, attacks, seed=seed, extra=hostile_extra)
            if visible is not None:
                seen = wait_for(lambda: (s := cluster.state()) and visible(s) and s, 60, f"{attacks} to show")
                out["seen"] = seen                 # (rank_drops count connected ranks only)
                out["seen_metrics"] = metrics(cluster)
                out["seen_at_step"] = seen["step"]
                out["seen_stopped"] = seen["stopped"]
                mark = (time.monotonic(), seen["step"])
        end = time.monotonic() + wait_s
        while all(p.p.poll() is None for p in ranks):   # the last state while every rank is there
            live = cluster.state()
            if live["n_connected"] >= 3 and not live["stopped"]:
                out["live"] = live
            if time.monotonic() > end:
                raise AssertionError(f"the honest ranks did not reach step {STEPS} in {wait_s:g} s: "
                                     f"{live['step']}\n{ranks[0].text()[-3000:]}")
            time.sleep(0.2)
        # the first rank out: the room reached STEPS about now
        out["rate"] = (STEPS - mark[1]) / max(1e-3, time.monotonic() - mark[0])
        for p in ranks:
            try:
                rc = p.p.wait(max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"a rank did not exit:\n{p.text()[-3000:]}") from None
            assert rc == 0, p.text()[-3000:]
        out["elapsed_s"] = time.monotonic() - t0
        out["state"] = cluster.state()
        out["metrics"] = metrics(cluster)
        finals = [r for r in cluster.reports(connected_only=False) if r.get("final")]
        out["digests"] = {r["id"]: r["digest"] for r in finals}
        out["steps"] = {r["id"]: r["step"] for r in finals}
        out["events"] = h.events() if h is not None else []
    finally:
        if h is not None:
            h.close()
    return out


def check_unharmed(run: dict, baseline: dict) -> None:
    """What every attack must leave as it was: the room stopped at STEPS by its own rule, the honest
    ranks bit-identical there, the final accuracy at most 1 point below the clean run's, and a kept
    checkpoint at least as good as the best before the attack."""
    st = run["state"]
    assert st["stopped"] and st["stop_reason"] == f"steps {STEPS} reached", st["stop_reason"]
    assert len(run["digests"]) == 3 and len(set(run["digests"].values())) == 1, run["digests"]   # bit-identical
    assert set(run["steps"].values()) == {STEPS}, run["steps"]
    ck = st["checkpoint"]
    assert ck["step"] == STEPS and ck["final"]
    # (at most 1 point below: with the attacker given shares, clipping changes the trajectory and
    # the final held-out accuracy lands a few samples either side of the clean run's)
    acc, base = ck["accuracy"], baseline["state"]["checkpoint"]["accuracy"]
    assert acc >= base - 0.01, (acc, base)
    best = max(c["accuracy"] for c in st["checkpoints"])
    assert run["before"] is None or best >= run["before"], (best, run["before"])
    for c in st["checkpoints"]:
        assert 0 <= c["step"] <= STEPS
