"""Helpers for process-group tests: free ports and a bounded launcher of real processes."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 60.0


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def launch(tmp_path, world: int, topology: str, mode: str = "all", extra_env: dict | None = None,
           per_rank_env: dict | None = None) -> list[dict]:
    """Run tests/pg/worker.py as ``world`` processes; return each rank's outcome and arrays."""
    ports = free_ports(world)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD=str(world), PEERS=peers, TOPOLOGY=topology,
                   PG_TEST_MODE=mode, PG_TEST_OUT=str(tmp_path / f"rank{r}"), PG_CONNECT_TIMEOUT_S="30",
                   PYTHONPATH=os.pathsep.join([str(ROOT / "client_py"), str(ROOT)]))
        env.update(extra_env or {})
        env.update((per_rank_env or {}).get(r, {}))
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.pg.worker"], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=LAUNCH_TIMEOUT_S)
            outs.append(out.decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for r, p in enumerate(procs):
        item: dict = {"rank": r, "rc": p.returncode, "log": outs[r]}
        jp, npz = tmp_path / f"rank{r}.json", tmp_path / f"rank{r}.npz"
        if jp.exists():
            item.update(json.loads(jp.read_text()))
        if npz.exists():
            import numpy as np

            with np.load(npz) as z:
                item["arrays"] = {k: z[k] for k in z.files}
        results.append(item)
    return results


@pytest.fixture
def run_group(tmp_path):
    return lambda *a, **k: launch(tmp_path, *a, **k)
