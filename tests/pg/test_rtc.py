"""WebRTC links through a real ``tabcohort serve`` (tabcohort.pg.rtc): real processes, real aiortc,
all on 127.0.0.1 (``PG_RTC_HOSTS=127.0.0.1``: aioice never offers loopback by itself). The bytes
must go over data channels, not the server relay; a rank that dies gives the others a clear
error within a bound."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

from .conftest import ROOT, collect, launch, start
from .test_collectives import check_every_collective

pytestmark = [pytest.mark.integration, pytest.mark.needs_numpy, pytest.mark.timeout(120)]
pytest.importorskip("aiortc")

ROOM = "pg"
SERVER_START_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One ``tabcohort serve`` (a mesh room) for the module's tests, which run one at a time."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "client_py"), str(ROOT / "server")]))
    with open(log, "wb") as fh:
        p = subprocess.Popen([sys.executable, "-m", "tabcohort.cli", "serve", "--port", "0", "--room", ROOM,
                              "--topology", "mesh"], stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        url = _wait_url(p, log)
        yield url
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def _wait_url(p: subprocess.Popen, log: pathlib.Path) -> str:
    end = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("URL "):
                return line.split()[1]
        if p.poll() is not None:
            raise AssertionError("serve exited:\n" + log.read_text(errors="replace"))
        if time.monotonic() > end:
            raise AssertionError(f"no server URL within {SERVER_START_TIMEOUT_S} s:\n" + log.read_text())
        time.sleep(0.05)  # polling the server's log file for its URL line


def rtc_env(url: str) -> dict:
    return {"PG_SERVER": url, "PG_ROOM": ROOM, "PG_RTC_HOSTS": "127.0.0.1"}


def test_every_collective_over_data_channels_two_groups_in_one_room(server, tmp_path):
    """A 2-rank star (group ``a``) and a 3-rank mesh (group ``b``) at once in one room: every
    collective right in each, every link a data channel, and the collectives' bytes on them: at
    most 1 % through the relay (a pair's frames take the relay whenever its channel is not usable,
    docs/PROTOCOL.md "Retry", which loses nothing; once, on a loaded host, 92 bytes did, against
    94,372 on the channels, cause not traced)."""
    env = rtc_env(server)
    a = start(tmp_path, 2, "star", extra_env=dict(env, PG_GROUP="a"), static=False, tag="a")
    b = start(tmp_path, 3, "mesh", extra_env=dict(env, PG_GROUP="b"), static=False, tag="b")
    for res, world, topology in ((collect(tmp_path, a), 2, "star"), (collect(tmp_path, b), 3, "mesh")):
        check_every_collective(res, world)
        for item in res:
            assert set(item["links"].values()) == {"rtc"} and len(item["links"]) == world - 1, item["links"]
            assert item["links_after"] == item["links"], item
            tb = item["transport_bytes"]
            assert tb["rtc"] > 50_000 and tb["relay"] <= 0.01 * tb["rtc"], tb
        print(f"\nWebRTC bring-up of {world} ranks ({topology}, another group in the room) through the server: "
              f"{max(r['connect_s'] for r in res):.2f} s; bytes per rank over data channels "
              f"{[r['transport_bytes']['rtc'] for r in res]}, over the relay "
              f"{[r['transport_bytes']['relay'] for r in res]}")


@pytest.mark.parametrize("topology", ["mesh"])
def test_peer_dies_mid_all_reduce_over_data_channels(server, tmp_path, topology):
    """Rank 2 exits inside an all_reduce; the server sees its socket close and tells the room,
    so the survivors raise PeerLostError well before the collective timeout."""
    timeout_s = 10.0
    env = dict(rtc_env(server), PG_TIMEOUT_S=str(timeout_s), PG_TEST_DIE_RANK="2", PG_TEST_DIE_BEFORE_SEND="1")
    res = launch(tmp_path, 3, topology, "die", extra_env=env, static=False)
    assert res[2]["rc"] == 3, res[2]["log"][-2000:]
    for item in res[:2]:
        assert item["rc"] == 0, item["log"][-2000:]
        assert item["error"] == "PeerLostError" and item["lost_rank"] == 2, item
        assert "connection to the server closed" in item["message"] or "reported by rank" in item["message"], item
        assert item["elapsed_s"] < timeout_s / 2, item
        assert item["later"] == "PeerLostError"
    print(f"\nWebRTC: a dead rank noticed by the survivors in {max(r['elapsed_s'] for r in res[:2]):.2f} s")


def test_two_processes_claiming_one_rank_both_refuse(server, tmp_path):
    """Both claimants of rank 0 fail with the clash named, well before the bound: the first to
    hear the other's hello makes sure its own hello reaches the other before it leaves (once, in
    CI, the second waited the whole bound out: "ranks never heard from")."""
    bound_s = 20.0
    env = dict(rtc_env(server), PG_CONNECT_TIMEOUT_S=str(bound_s), PG_GROUP="dup")
    for item in collect(tmp_path, start(tmp_path, 2, "mesh", extra_env=env, per_rank_env={1: {"RANK": "0"}},
                                        static=False)):
        assert item["rc"] == 2 and item["error"] == "GroupSetupError", item["log"][-2000:]
        assert item["elapsed_s"] < bound_s / 2, item
        assert "two processes claim rank 0 of group" in item["message"], item
        assert "give each process its own RANK" in item["message"], item


@pytest.mark.slow
def test_a_group_that_comes_up_short_names_the_missing_rank(server, tmp_path):
    """WORLD=3 but only ranks 0 and 1 start: both give up at the bound, naming rank 2 (slow: it
    waits the bound out)."""
    bound_s = 10.0
    env = dict(rtc_env(server), PG_CONNECT_TIMEOUT_S=str(bound_s), PG_GROUP="short")
    for item in collect(tmp_path, start(tmp_path, 3, "mesh", extra_env=env, static=False, ranks=[0, 1])):
        assert item["rc"] == 2 and item["error"] == "GroupSetupError", item["log"][-2000:]
        msg = item["message"]
        # the first to reach its bound says so and leaves; the other may see that first
        assert (f"not ready within {bound_s:g} s (PG_CONNECT_TIMEOUT_S)" in msg
                or f"rank {1 - item['rank']} left room 'pg' during bring-up" in msg), msg
        assert "never heard from: [2]" in msg, msg
        assert bound_s - 0.5 < item["elapsed_s"] < bound_s + 10, item  # elapsed includes imports
