"""examples/ as a user runs them: the process-group example gives every rank the same sums, and a
missing peer is a one-line error within PG_CONNECT_TIMEOUT_S (exit 1, no traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from .conftest import ROOT, free_ports

EXAMPLE = ROOT / "examples" / "allreduce.py"


def _env(**kw: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "client_py"), os.environ.get("PYTHONPATH", "")]))
    for k in ("RANK", "WORLD", "PEERS", "TOPOLOGY", "DISCOVERY", "PG_GROUP", "PG_SERVER", "PG_ROOM"):
        env.pop(k, None)
    env.update(kw)
    return env


def test_allreduce_example_prints_the_same_sums_on_every_rank():
    peers = ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
    procs = [subprocess.Popen([sys.executable, str(EXAMPLE)], env=_env(RANK=str(r), WORLD="2", PEERS=peers),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert "sum[0]=3 (expect 3)" in out, out


def test_allreduce_example_with_a_missing_peer_is_a_clear_error_within_the_bound():
    peers = ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=60,
                       env=_env(RANK="0", WORLD="2", PEERS=peers, PG_CONNECT_TIMEOUT_S="2"))
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    assert "GroupSetupError" in r.stderr and "[1]" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "waiting up to 2 s" in r.stderr, r.stderr     # it says what it waits for first
    assert took < 2 + 10, took


def test_allreduce_example_names_a_bad_setting_before_it_says_it_waits():
    # `RANK=x` printed "rank x of 2: waiting up to 60 s ..." above the configuration error
    r = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=60,
                       env=_env(RANK="x", WORLD="2", PEERS="127.0.0.1:1,127.0.0.1:2"))
    assert r.returncode == 2, r.stderr
    assert "configuration error: RANK='x'" in r.stderr and "waiting" not in r.stderr, r.stderr
