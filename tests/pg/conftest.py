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


PG_VARS = ("RANK", "WORLD", "WORLD_SIZE", "PEERS", "TOPOLOGY", "DISCOVERY", "PG_GROUP", "PG_DISCOVERY_INTERFACES",
           "PG_SERVER", "PG_ROOM", "PG_TOKEN", "PG_RTC_HOSTS", "PG_ICE_SERVERS", "PG_TIMEOUT_S",
           "PG_CONNECT_TIMEOUT_S", "MAX_MEMORY_BYTES", "PG_LISTEN_HOST", "PG_LISTEN_PORT")


def rank_env(tmp_path, rank: int, world: int, topology: str, mode: str, *, tag: str = "") -> dict:
    """A worker's environment without any source of peers (the caller adds PEERS, DISCOVERY or
    PG_SERVER); the process group's variables from this environment are dropped."""
    env = {k: v for k, v in os.environ.items() if k not in PG_VARS}
    env.update(RANK=str(rank), WORLD=str(world), TOPOLOGY=topology, PG_TEST_MODE=mode,
               PG_TEST_OUT=str(tmp_path / f"{tag}rank{rank}"), PG_CONNECT_TIMEOUT_S="30", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "client_py"), str(ROOT), str(ROOT / "server")]))
    return env


def worker_cmd() -> list[str]:
    return [sys.executable, "-m", "tests.pg.worker"]


def launch(tmp_path, world: int, topology: str, mode: str = "all", extra_env: dict | None = None,
           per_rank_env: dict | None = None, *, static: bool = True, tag: str = "",
           prefix: dict | None = None) -> list[dict]:
    """Run tests/pg/worker.py as ``world`` processes; return each rank's outcome and arrays.

    Args:
        static: give PEERS (free loopback ports); otherwise the caller's env says how to connect.
        tag: prefix of the result files (two groups in one tmp dir).
        prefix: per rank, a command prefix (e.g. ``["ip", "netns", "exec", NS]``).
    """
    return collect(tmp_path, start(tmp_path, world, topology, mode, extra_env, per_rank_env, static=static,
                                   tag=tag, prefix=prefix))


def start(tmp_path, world: int, topology: str, mode: str = "all", extra_env: dict | None = None,
          per_rank_env: dict | None = None, *, static: bool = True, tag: str = "",
          prefix: dict | None = None, ranks: list[int] | None = None) -> list[subprocess.Popen]:
    """Start the workers of :func:`launch` (collect them with :func:`collect`); ``ranks``: only
    these ranks of the world (default all)."""
    peers = ",".join(f"127.0.0.1:{p}" for p in free_ports(world)) if static else None
    procs = []
    for r in (range(world) if ranks is None else ranks):
        env = rank_env(tmp_path, r, world, topology, mode, tag=tag)
        if peers:
            env["PEERS"] = peers
        env.update(extra_env or {})
        env.update((per_rank_env or {}).get(r, {}))
        p = subprocess.Popen([*(prefix or {}).get(r, []), *worker_cmd()], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        p.pg_rank, p.pg_tag = r, tag  # type: ignore[attr-defined]
        procs.append(p)
    return procs


def collect(tmp_path, procs: list[subprocess.Popen]) -> list[dict]:
    """Wait (bounded) for the workers; return each rank's exit code, log, outcome and arrays."""
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
    for i, p in enumerate(procs):
        r, tag = p.pg_rank, p.pg_tag  # type: ignore[attr-defined]
        item: dict = {"rank": r, "rc": p.returncode, "log": outs[i]}
        jp, npz = tmp_path / f"{tag}rank{r}.json", tmp_path / f"{tag}rank{r}.npz"
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
