"""Robustness over real processes on loopback: a rank whose socket drops resumes its
id and stays in the cohort; a server restarted on the same port and checkpoint directory re-seats
every rank with its id and training goes on; graceful shutdown closes sockets with GOING_AWAY; a
mesh peer that vanishes without a close (SIGSTOP) is detected within a bound. Every wait is a
bounded poll; nothing sleeps to wait."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse

import pytest

from .conftest import wait_for

pytestmark = pytest.mark.integration


def _connected(cluster) -> dict[int, dict]:
    """id -> last report of each connected rank."""
    return {r["id"]: r["report"] for r in cluster.state()["ranks"] if r["connected"] and r["report"]}


def _trained_to(cluster, n: int, step: int, timeout_s: float = 60) -> dict:
    return wait_for(lambda: (s := cluster.state())["step"] >= step
                    and len([r for r in s["ranks"] if r["connected"]]) == n and s, timeout_s,
                    f"{n} connected ranks and step >= {step}")


def _port(cluster) -> int:
    return urllib.parse.urlsplit(cluster.url).port


def _kill_server_side_socket(server_port: int, rank_pid: int) -> int:
    """Abort (RST) the server's end of ``rank_pid``'s WebSocket with ``ss -K`` (sock_diag destroy)."""
    out = subprocess.run(["ss", "-tnpH", "state", "established", "dport", f"= :{server_port}"],
                         capture_output=True, text=True, timeout=10).stdout
    ports = [int(m.group(1)) for line in out.splitlines() if f"pid={rank_pid}," in line
             for m in [re.search(r"127\.0\.0\.1:(\d+)\s+127\.0\.0\.1:%d" % server_port, line)] if m]
    if not ports:
        return 0
    for p in ports:  # the server's socket: local = server port, peer = the rank's port
        subprocess.run(["ss", "-K", "state", "established", "sport", f"= :{server_port}", "dport", f"= :{p}"],
                       capture_output=True, text=True, timeout=10)
    return len(ports)


@pytest.mark.skipif(shutil.which("ss") is None or os.geteuid() != 0, reason="needs ss -K (root)")
def test_dropped_rank_socket_resumes_its_id_and_stays_in_the_cohort(cluster):
    cluster.serve()
    ranks = [cluster.rank() for _ in range(2)]
    _trained_to(cluster, 2, 20)
    victim = ranks[0]
    # a rank reports about once a second: wait until both have reported at least once
    before = wait_for(lambda: (c := _connected(cluster)) and {r["pid"] for r in c.values()} >= {p.p.pid for p in ranks}
                      and c, 20, "a report from each rank")
    vid = next(k for k, r in before.items() if r["pid"] == victim.p.pid)
    oid = next(k for k in before if k != vid)
    step0 = cluster.state()["step"]
    t0 = time.monotonic()
    assert _kill_server_side_socket(_port(cluster), victim.p.pid) >= 1
    wait_for(lambda: "link lost" in victim.text(), 10, "the rank to see its link drop")
    # it comes back with the same id (no new seat), the other rank never left, training goes on
    st = _trained_to(cluster, 2, step0 + 30, 30)
    t_back = time.monotonic() - t0
    now = _connected(cluster)
    assert set(now) == {vid, oid}, now
    assert len(st["ranks"]) == 2, st["ranks"]  # no third seat: the id was resumed
    assert all(p.p.poll() is None for p in ranks)
    rep = wait_for(lambda: (r := _connected(cluster).get(vid)) and r["step"] > step0 + 30 and r, 10,
                   "a report of the resumed rank")
    assert rep["cohort"] == 2 and rep["ready"], rep
    print(f"\nsocket killed at step {step0}; rank {vid:08x} resumed its id, step {st['step']} "
          f"{t_back:.1f} s later")


def _go_away_code(url: str, room: str, on_welcome) -> int | None:
    import aiohttp

    async def run() -> int | None:
        async with aiohttp.ClientSession() as s:
            ws_url = url.replace("http", "ws", 1) + f"/api/rooms/{room}/ws"
            async with s.ws_connect(ws_url) as ws:
                await ws.send_str(json.dumps({"type": "register", "version": 1}))
                msg = await ws.receive(10)
                assert json.loads(msg.data)["type"] == "welcome"
                await asyncio.get_running_loop().run_in_executor(None, on_welcome)
                end = time.monotonic() + 20
                while time.monotonic() < end:
                    msg = await ws.receive(end - time.monotonic())
                    if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):
                        return ws.close_code
                return None
    return asyncio.run(run())


@pytest.mark.parametrize("topology", ["star", pytest.param("mesh", marks=pytest.mark.slow)])
def test_server_restart_ranks_resume_their_ids_and_training_continues(cluster, tmp_path, topology):
    """(mesh: the ranks' data channels outlive the server; their signalling sockets resume)"""
    ck = str(tmp_path / "ck")
    extra = ("--topology", "mesh") if topology == "mesh" else ()
    rank_args = ("--rtc-hosts", "127.0.0.1") if topology == "mesh" else ()
    if topology == "mesh":
        pytest.importorskip("aiortc")
    cluster.serve("--checkpoint-dir", ck, "--checkpoint-interval", "1", *extra)
    port = _port(cluster)
    ranks = [cluster.rank(*rank_args) for _ in range(3)]
    _trained_to(cluster, 3, 30)
    ids = set(wait_for(lambda: (c := _connected(cluster)) and len(c) == 3 and c, 10, "3 reports"))
    step0 = cluster.state()["step"]
    # graceful shutdown: a client socket sees GOING_AWAY (1001)
    old = cluster.server
    code = _go_away_code(cluster.url, cluster.room, lambda: old.p.send_signal(signal.SIGTERM))
    assert code == 1001, code
    assert old.p.wait(20) == 0, old.text()
    t_down = time.monotonic()
    cluster.serve("--checkpoint-dir", ck, "--checkpoint-interval", "1", "--port", str(port), *extra)
    t0 = time.monotonic()
    st = wait_for(lambda: (s := cluster.state()) and len([r for r in s["ranks"] if r["connected"]]) == 3 and s,
                  40, "the 3 ranks to reconnect to the restarted server")
    t_back = time.monotonic() - t0
    assert {r["id"] for r in st["ranks"]} == ids, st["ranks"]  # resumed, not re-seated
    reps = wait_for(lambda: (rs := _connected(cluster)) and len(rs) == 3 and all(
        r["step"] >= step0 + 30 and r["cohort"] == 3 for r in rs.values()) and rs, 40,
        "training to go on with all 3 ranks")
    assert set(reps) == ids
    assert all(p.p.poll() is None for p in ranks), cluster.logs()
    print(f"\nserver down {t0 - t_down:.1f} s from step {step0}; 3 ranks back with their ids {t_back:.1f} s "
          f"after it listened again; cohort of 3 at step {max(r['step'] for r in reps.values())} "
          f"{time.monotonic() - t0:.1f} s after")


def test_mesh_peer_that_vanishes_without_a_close_is_detected_within_the_bound(cluster):
    """SIGSTOP one of three mesh ranks: no close event reaches anyone. The protocol drops it from
    the cohort (drop period), the others' channels to it are declared dead after the idle bound
    (max(5 s, 10 beats)) and reported as a link change, and training goes on without it."""
    pytest.importorskip("aiortc")
    cluster.serve("--topology", "mesh")
    ranks = [cluster.rank("--rtc-hosts", "127.0.0.1") for _ in range(3)]
    wait_for(lambda: (rs := _connected(cluster)) and len(rs) == 3 and all(
        r["step"] >= 20 and set((r.get("links") or {}).values()) == {"rtc"} and len(r["links"]) == 2
        for r in rs.values()) and rs, 60, "3 mesh ranks on data channels, step >= 20")
    victim = ranks[2]
    vid = next(k for k, r in _connected(cluster).items() if r["pid"] == victim.p.pid)
    vhex = f"{vid:08x}"
    victim.p.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        step0 = cluster.state()["step"]
        idle_bound = 5.0 + 0.25 + 1.0  # idle timeout + supervisor tick + report interval
        alive = [p for p in ranks if p is not victim]

        def others(pred):
            rs = [r for r in _connected(cluster).values() if r["pid"] in {p.p.pid for p in alive}]
            return len(rs) == 2 and all(pred(r) for r in rs) and rs
        wait_for(lambda: others(lambda r: r["cohort"] == 2), 1.6 + 3.2 + 1.0 + 5, "the cohort to drop the peer")
        t_cohort = time.monotonic() - t0
        wait_for(lambda: others(lambda r: (r.get("links") or {}).get(vhex) == "relay"), idle_bound + 5,
                 "the vanished peer's channels to be declared dead")
        t_link = time.monotonic() - t0
        rs = wait_for(lambda: others(lambda r: r["step"] >= step0 + 50 and r["cohort"] == 2), 30,
                      "the other two to keep training")
        assert all(p.p.poll() is None for p in alive)
        assert all(list(r["links"].values()).count("rtc") == 1 for r in rs), rs  # their own pair is fine
        print(f"\nSIGSTOPped mesh peer: out of the cohort after {t_cohort:.1f} s, channels declared dead "
              f"after {t_link:.1f} s (bound {idle_bound:.2f} s + polling), training went on")
        assert t_link <= idle_bound + 2.0
    finally:
        victim.p.send_signal(signal.SIGCONT)
