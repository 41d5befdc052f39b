"""Several ``tabcohort serve`` nodes as one cluster through a real ``redis-server`` (README
"Cluster"): listing across nodes, ranks sent to the owner, failover after SIGKILL with the room's
checkpoint from the shared directory, a Redis outage, and bad configuration."""

from __future__ import annotations

import json
import math
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tabcohort_server import checkpoint as ckpt

from .conftest import Proc, wait_for

OP = "operator-token-for-tests-0123"
ROOM = "digits"
LEASE_MS, TICK_MS, TAKEOVER_MS, STAGGER_MS = 2000, 400, 2000, 1000
#: the stated failover bound (cluster.ClusterTiming.failover_bound_ms with two eligible nodes)
#: plus what a loaded 2-core machine adds: a node's tick is late, the claim and the checkpoint load
FAILOVER_BOUND_S = (LEASE_MS + TICK_MS + TAKEOVER_MS + STAGGER_MS) / 1000 + 3.0
#: the digits job's loss at a fresh init: cross-entropy of 10 classes at chance
FRESH_LOSS = math.log(10)
#: the nodes' roll call after they take the room up (serve --roll-call and --grace; 30 s by
#: default, the ranks' reconnect bound): the ranks here come back to a node that took the room
#: over within a few seconds (their reconnect attempts are at most 10 s apart), and a node's
#: first claim made fresh ranks wait the whole window before one could bootstrap (~30 s a test)
ROLL_CALL_S = 15
#: a Redis outage past every cluster timer (the lease, then the takeover and its stagger) and
#: 2 s more: the owner's lease lapses in it, and the owner keeps relaying (was 10 s; Redis down
#: >= 5 s of it on the node's own clock is asserted)
OUTAGE_S = (LEASE_MS + TAKEOVER_MS + STAGGER_MS) / 1000 + 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A real redis-server (Debian's package) on a free loopback port, no persistence."""

    def __init__(self, tmp: pathlib.Path) -> None:
        self.exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.port = _free_port()
        self.tmp = tmp
        self.p: subprocess.Popen | None = None
        self.n_starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.n_starts += 1
        log = open(self.tmp / f"redis{self.n_starts}.log", "wb")
        self.p = subprocess.Popen([self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--dir", str(self.tmp)], stdout=log, stderr=subprocess.STDOUT)
        wait_for(self.ping, 10, "redis-server to answer PING")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)


@pytest.fixture
def redis_server(tmp_path: pathlib.Path):
    if shutil.which("redis-server") is None and not pathlib.Path("/usr/bin/redis-server").exists():
        pytest.skip("redis-server is not installed (apt-get install redis-server; scripts/install-test.sh)")
    r = RedisServer(tmp_path)
    r.start()
    yield r
    r.kill()


class Node:
    """One ``tabcohort serve --redis`` process."""

    def __init__(self, tmp: pathlib.Path, name: str, redis_url: str, ckdir: pathlib.Path, *extra: str) -> None:
        self.name = name
        self.proc = Proc(["serve", "--port", "0", "--room", ROOM, "--operator-token", OP,
                          "--checkpoint-dir", str(ckdir), "--checkpoint-interval", "1",
                          "--redis", redis_url, "--node-id", name,
                          "--cluster-lease-ms", str(LEASE_MS), "--cluster-tick-ms", str(TICK_MS),
                          "--cluster-takeover-ms", str(TAKEOVER_MS),
                          "--roll-call", str(ROLL_CALL_S), "--grace", str(ROLL_CALL_S), *extra],
                         tmp / f"node-{name}.log")

        def url() -> str | None:
            for line in self.proc.text().splitlines():
                if line.startswith("URL "):
                    return line.split()[1]
            if self.proc.p.poll() is not None:
                raise AssertionError(f"node {name} exited:\n" + self.proc.text())
            return None
        self.url = wait_for(url, 60, f"node {name}'s URL")

    def get(self, path: str, *, follow: bool = True) -> tuple[int, dict | str, dict]:
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {OP}"})
        opener = urllib.request.build_opener(*(() if follow else (_NoRedirect(),)))
        try:
            with opener.open(req, timeout=5) as r:
                body = r.read().decode()
                return r.status, (json.loads(body) if body.startswith("{") else body), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(), dict(e.headers)

    def state(self) -> dict:
        return self.get(f"/api/rooms/{ROOM}")[1]

    def rooms(self) -> dict:
        return self.get("/api/rooms")[1]

    def metrics(self) -> dict[str, float]:
        text = self.get("/metrics")[1]
        out = {}
        for line in str(text).splitlines():
            if line.startswith("tabcohort_cluster_"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *a, **k):  # noqa: D401 - urllib's hook
        return None


def _owner(node: Node) -> str | None:
    rooms = node.rooms()
    got = [r for r in rooms.get("rooms", []) if r["room"] == ROOM]
    return got[0]["owner"] if got else None


def _logs(*procs: Proc) -> str:
    return "\n".join(f"--- {p.log.name}\n{p.text()[-4000:]}" for p in procs)


def _rank(tmp: pathlib.Path, server: str, n: int) -> Proc:
    """A native rank with the cluster's trainer credential (the nodes keep it in the shared
    checkpoint directory), so it may lead (docs/PROTOCOL.md, "Untrusted ranks")."""
    token = (tmp / "shared-ckpt" / ".trainer-token").read_text().strip()
    return Proc(["rank", "--server", server, "--room", ROOM], tmp / f"rank{n}.log",
                env={"TABCOHORT_TRAINER_TOKEN": token})


def start_a_then_b(tmp_path: pathlib.Path, redis_url: str, procs: list[Proc], *extra: str) -> tuple[Node, Node]:
    """Node A, once it owns the room, then node B, sharing ``tmp_path / "shared-ckpt"``; their
    processes are appended to ``procs`` (the caller kills them)."""
    ckdir = tmp_path / "shared-ckpt"
    a = Node(tmp_path, "A", redis_url, ckdir, *extra)
    procs.append(a.proc)
    wait_for(lambda: _owner(a) == "A", 10, "node A to own the room")
    b = Node(tmp_path, "B", redis_url, ckdir, *extra)
    procs.append(b.proc)
    return a, b


def test_a_room_on_node_a_is_listed_by_b_a_rank_at_b_trains_on_a_and_b_takes_over_after_sigkill(
        redis_server, tmp_path):
    ckdir = tmp_path / "shared-ckpt"          # one directory both nodes read and write
    procs: list[Proc] = []
    try:
        a, b = start_a_then_b(tmp_path, redis_server.url, procs)
        # listed by B with its owner; B's API and page send clients to A (307), B's socket to A (4012)
        listed = [r for r in b.rooms()["rooms"] if r["room"] == ROOM][0]
        assert listed["owner"] == "A" and listed["owner_url"] == a.url, listed
        code, _, headers = b.get(f"/api/rooms/{ROOM}/job", follow=False)
        assert code == 307 and headers["Location"] == f"{a.url}/api/rooms/{ROOM}/job"
        code, _, headers = b.get(f"/?room={ROOM}", follow=False)
        assert code == 307 and headers["Location"] == f"{a.url}/?room={ROOM}"
        # a page that says A died (a tab's failover) while A's heartbeat is live goes back to A
        code, _, headers = b.get(f"/?room={ROOM}&failover={a.url}", follow=False)
        assert code == 307 and headers["Location"].startswith(f"{a.url}/?room={ROOM}"), (code, headers)
        assert a.url in [n["url"] for n in b.rooms()["nodes"]]   # (what a page keeps for its failover)
        for bad in ("javascript:alert(1)", "<b>x</b>", "http://", "x" * 3000):   # not an origin: ignored
            code, _, headers = b.get(f"/?room={ROOM}&failover={urllib.parse.quote(bad)}", follow=False)
            assert code == 307 and headers["Location"].startswith(f"{a.url}/?room={ROOM}"), (bad, code)

        ranks = [_rank(tmp_path, b.url, i) for i in range(2)]     # pointed at B
        procs += ranks
        st = wait_for(lambda: (s := a.state())["n_connected"] == 2 and s["step"] >= 200 and s
                      and (s.get("checkpoint") or {}).get("step", 0) >= 100 and s, 60,
                      "2 ranks to train on node A with a checkpoint")
        assert b.get(f"/api/rooms/{ROOM}", follow=False)[0] == 307
        first_loss = st["loss"]
        assert first_loss < 0.5 * FRESH_LOSS      # trained on A
        wait_for(lambda: (c := a.state()["checkpoint"]) and c["step"] > st["checkpoint"]["step"], 10,
                 "a later checkpoint")
        ids_before = sorted(r["id"] for r in a.state()["ranks"] if r["connected"])
        last_loss_on_a = a.state()["loss"]

        t_kill = time.monotonic()
        a.proc.p.send_signal(signal.SIGKILL)
        a.proc.p.wait(10)
        on_disk = ckpt.load(str(ckdir), ROOM)
        assert on_disk is not None
        ck_step = on_disk[0]["step"]

        wait_for(lambda: _owner(b) == "B", FAILOVER_BOUND_S + 5, "node B to own the room")
        took = time.monotonic() - t_kill
        print(f"\nfailover: node B owns the room {took:.2f} s after SIGKILL of A (lease {LEASE_MS} ms; "
              f"bound {FAILOVER_BOUND_S:.1f} s)")
        assert took <= FAILOVER_BOUND_S
        sb = b.state()
        assert sb["resumed_from_step"] == ck_step, (sb["resumed_from_step"], ck_step)
        assert b.get(f"/?room={ROOM}&failover={a.url}", follow=False)[0] == 200   # the moved page, here

        # the ranks, sent back to B by their reconnect, resume their ids there and train on
        sb = wait_for(lambda: (s := b.state())["n_connected"] == 2 and s["loss"] is not None
                      and s["step"] > ck_step and s, 40, "both ranks to resume on node B")
        resumed_s = time.monotonic() - t_kill
        ids_after = sorted(r["id"] for r in sb["ranks"] if r["connected"])
        assert ids_after == ids_before
        first_loss_on_b = sb["loss"]
        print(f"ranks resumed on B {resumed_s:.2f} s after the kill; loss: on A at step {st['step']} "
              f"{first_loss:.4f}, last on A {last_loss_on_a:.4f}, first on B {first_loss_on_b:.4f} "
              f"(step {sb['step']} >= checkpoint {ck_step}; a fresh init is {FRESH_LOSS:.2f})")
        assert math.isfinite(first_loss_on_b)
        assert first_loss_on_b <= max(3 * last_loss_on_a, last_loss_on_a + 0.05)
        assert first_loss_on_b < 0.1 * FRESH_LOSS

        # a rank that joins B now starts from the checkpoint B loaded from the shared directory
        fresh = _rank(tmp_path, b.url, 2)
        procs.append(fresh)
        # ("loaded checkpoint [ID] at step N (DIGEST)": the id of the history entry, when it has one)
        got = wait_for(lambda: next((m for ln in fresh.text().splitlines()
                                     if (m := re.search(r"loaded checkpoint (\S+ )?at step (\d+)", ln))), None),
                       30, "the fresh rank to load B's checkpoint")
        assert int(got.group(2)) >= ck_step

        # stop on B: every rank ends with the leader's parameters, and so does B's final checkpoint
        # (ready, each of them: a rank that is still joining at the stop leaves with the
        # checkpoint it loaded, not the final model)
        wait_for(lambda: (s := b.state())["n_connected"] == 3
                 and sum(bool(r["connected"] and r["report"] and r["report"].get("ready")) for r in s["ranks"]) == 3,
                 60, "3 ready ranks on B")
        req = urllib.request.Request(f"{b.url}/api/rooms/{ROOM}/stop", data=b"", method="POST",
                                     headers={"Authorization": f"Bearer {OP}"})
        urllib.request.urlopen(req, timeout=5).close()
        finals = wait_for(lambda: (fs := [r["report"] for r in b.state()["ranks"]
                                          if r["report"] and r["report"].get("final")]) and len(fs) == 3 and fs,
                          30, "3 final reports")
        digests = {r["digest"] for r in finals}
        assert len(digests) == 1, finals
        for p in ranks + [fresh]:
            assert p.p.wait(30) == 0, p.text()
        final = wait_for(lambda: (c := b.state()["checkpoint"]) and c["final"] and c, 10, "B's final checkpoint")
        assert final["digest"] in digests
        print(f"stop on B at step {final['step']}: 3 ranks bit-identical ({final['digest'][:16]})")
    except BaseException:
        print(_logs(*procs))
        raise
    finally:
        for p in procs:
            p.kill()
            p.fh.close()


def test_a_redis_outage_keeps_rooms_relaying_and_the_owner_reasserts_its_room(redis_server, tmp_path):
    ckdir = tmp_path / "shared-ckpt"
    procs: list[Proc] = []
    try:
        a = Node(tmp_path, "A", redis_server.url, ckdir)
        procs.append(a.proc)
        wait_for(lambda: _owner(a) == "A", 10, "node A to own the room")
        b = Node(tmp_path, "B", redis_server.url, ckdir)
        procs.append(b.proc)
        rank = _rank(tmp_path, a.url, 0)
        procs.append(rank)
        wait_for(lambda: a.state()["step"] > 50, 60, "the rank to train on A")

        redis_server.kill()
        t0 = time.monotonic()
        steps = [a.state()["step"]]
        m = wait_for(lambda: (m := a.metrics()).get("tabcohort_cluster_redis_up") == 0.0 and m, 5,
                     "A's /metrics to show Redis down")
        while time.monotonic() - t0 < OUTAGE_S:   # the room relays throughout
            s = a.state()
            assert s["n_connected"] == 1 and s["step"] >= steps[-1]
            steps.append(s["step"])
            time.sleep(0.5)
        m = a.metrics()
        print(f"\noutage {OUTAGE_S:.0f} s: room step {steps[0]} -> {steps[-1]}; A metrics {m}")
        assert steps[-1] > steps[0] + 100
        assert m["tabcohort_cluster_redis_up"] == 0.0 and m["tabcohort_cluster_redis_down_seconds"] >= 5
        assert m[f'tabcohort_cluster_room_owned{{room="{ROOM}"}}'] == 1.0
        assert m[f'tabcohort_cluster_lease_unconfirmed{{room="{ROOM}"}}'] == 1.0
        assert b.rooms()["cluster"] == "unavailable"

        redis_server.start()                      # back, empty: the owner re-asserts its lease
        wait_for(lambda: a.metrics().get("tabcohort_cluster_redis_up") == 1.0, 10, "A to reach Redis again")
        wait_for(lambda: _owner(b) == "A", 10, "B to see A own the room again")
        ma, mb = a.metrics(), b.metrics()
        assert ma['tabcohort_cluster_events_total{event="reasserted"}'] + ma[
            'tabcohort_cluster_events_total{event="claims"}'] >= 2, ma
        assert mb['tabcohort_cluster_events_total{event="claims"}'] == 0.0, mb
        assert ma[f'tabcohort_cluster_lease_unconfirmed{{room="{ROOM}"}}'] == 0.0
        assert a.state()["n_connected"] == 1
        # B does not take the room after its takeover period either
        t1 = time.monotonic()
        while time.monotonic() - t1 < (TAKEOVER_MS + STAGGER_MS + 2 * TICK_MS) / 1000:
            assert _owner(b) == "A"
            time.sleep(0.3)
    except BaseException:
        print(_logs(*procs))
        raise
    finally:
        for p in procs:
            p.kill()
            p.fh.close()


@pytest.mark.parametrize("url, why", [
    ("http://127.0.0.1:6379/0", "expected a redis://"),
    ("redis://127.0.0.1:6379/zero", "is not a number"),
    ("redis://127.0.0.1:{closed}/0", "Redis does not answer"),
])
def test_bad_redis_configuration_is_an_error_naming_the_flag_before_serving(tmp_path, url, why):
    url = url.format(closed=_free_port())
    port = _free_port()
    p = Proc(["serve", "--port", str(port), "--room", ROOM, "--dataset", "synthetic", "--redis", url],
             tmp_path / "serve.log")
    try:
        assert p.p.wait(60) == 2, p.text()
    finally:
        p.kill()
        p.fh.close()
    out = p.text()
    assert "configuration error: --redis" in out and why in out and url in out, out
    assert "URL " not in out          # it never served


def test_tabcohort_redis_variable_is_named_when_it_is_bad(tmp_path):
    import sys

    from .conftest import ROOT, _env
    env = dict(_env(), TABCOHORT_REDIS="redis://127.0.0.1:notaport/0")
    r = subprocess.run([sys.executable, "-m", "tabcohort.cli", "serve", "--port", "0",
                        "--dataset", "synthetic"], env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "TABCOHORT_REDIS" in r.stderr, r.stderr


def test_tabcohort_node_id_variable_is_named_when_it_is_bad():
    # (a bad value from TABCOHORT_NODE_ID was reported as --node-id, a flag the user never gave)
    import sys

    from .conftest import ROOT, _env
    env = dict(_env(), TABCOHORT_REDIS="redis://127.0.0.1:6379/0", TABCOHORT_NODE_ID="bad id!")
    r = subprocess.run([sys.executable, "-m", "tabcohort.cli", "serve", "--port", "0",
                        "--dataset", "synthetic"], env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "TABCOHORT_NODE_ID='bad id!'" in r.stderr, r.stderr


def test_a_socket_that_registers_after_its_node_lost_the_room_is_sent_to_the_owner(redis_server, tmp_path):
    # a hostile trial: a socket accepted while node A owned the room, registering after a lease
    # handover, was welcomed by A, which no longer owned it: a copy of the room no rank reached
    import asyncio

    import aiohttp

    procs: list[Proc] = []
    try:
        a, b = start_a_then_b(tmp_path, redis_server.url, procs)

        def a_lost_it() -> bool:
            return any("room_owned" in k and v == 0 for k, v in a.metrics().items())

        async def main() -> tuple[int | None, str | None]:
            async with aiohttp.ClientSession() as s:
                late = await s.ws_connect(a.url.replace("http://", "ws://") + f"/api/rooms/{ROOM}/ws")
                a.proc.p.send_signal(signal.SIGSTOP)       # A misses its renewals: B takes the room
                try:
                    await asyncio.to_thread(wait_for, lambda: _owner(b) == "B", 8, "node B to own the room")
                finally:
                    a.proc.p.send_signal(signal.SIGCONT)
                await asyncio.to_thread(wait_for, a_lost_it, 5, "node A to see it lost the room")
                await late.send_str(json.dumps({"type": "register"}))
                msg = await late.receive(timeout=10)
                return late.close_code, msg.extra
        code, where = asyncio.run(main())
        assert code == 4012 and where == b.url, (code, where, _logs(*procs))
    finally:
        for p in procs:
            p.kill()


def test_an_advertise_url_longer_than_a_close_reason_is_named(tmp_path):
    # ranks are sent the owner's URL in a WebSocket close reason (4012), cut at 120 bytes: a
    # longer --advertise-url reached them truncated, naming another host or port
    from tabcohort.errors import ConfigError
    from tabcohort_server.cluster import ClusterConfig

    long_url = "http://" + "n" * 120 + ".example:8080"
    with pytest.raises(ConfigError) as e:
        ClusterConfig(redis_url="redis://127.0.0.1:6379/0", node_id="A", advertise_url=long_url).validate()
    assert e.value.variable == "--advertise-url" and "120 bytes" in e.value.reason


def test_a_node_whose_room_job_differs_says_why_it_does_not_take_the_room_over(redis_server, tmp_path):
    # a new-user trial: nodes started with other room settings (--local-steps 4 and 8): after the
    # owner died the other never took the room over, and said nothing (only a metric counted)
    procs: list[Proc] = []
    try:
        ckdir = tmp_path / "shared-ckpt"
        a = Node(tmp_path, "A", redis_url=redis_server.url, ckdir=ckdir)
        procs.append(a.proc)
        wait_for(lambda: _owner(a) == "A", 10, "node A to own the room")
        b = Node(tmp_path, "B", redis_server.url, ckdir, "--local-steps", "4")
        procs.append(b.proc)
        a.proc.kill()
        wait_for(lambda: "will not take over room digits" in b.proc.text(), 20, "node B to say why")
        assert "is not this node's" in b.proc.text() and b.proc.text().count("will not take over") == 1
    finally:
        for p in procs:
            p.kill()


def test_ranks_whose_server_is_the_owner_that_dies_find_the_other_node(redis_server, tmp_path):
    # a new-user trial: ranks pointed at the owner node (the `join:` line it prints) kept no other
    # node to ask when it died; each trained alone until it gave up reconnecting (30 s). Their
    # welcome now names the other nodes that can host the room, which a reconnect asks in turn.
    procs: list[Proc] = []
    try:
        a, b = start_a_then_b(tmp_path, redis_server.url, procs)
        wait_for(lambda: any(n.get("url") == b.url for n in a.rooms().get("nodes", [])), 10,
                 "node A to see node B")
        ranks = [_rank(tmp_path, a.url, i) for i in range(2)]   # pointed at the owner itself
        procs += ranks
        st = wait_for(lambda: (s := a.state())["n_connected"] == 2 and s["step"] >= 200 and s, 60,
                      "2 ranks to train on node A")
        ids_before = sorted(r["id"] for r in st["ranks"] if r["connected"])
        a.proc.p.send_signal(signal.SIGKILL)
        a.proc.p.wait(10)
        wait_for(lambda: _owner(b) == "B", FAILOVER_BOUND_S + 5, "node B to own the room")
        sb = wait_for(lambda: (s := b.state()) and s.get("n_connected") == 2 and s["step"] > 0 and s,
                      25, "both ranks to resume on node B, whose URL they never had")
        assert sorted(r["id"] for r in sb["ranks"] if r["connected"]) == ids_before
        assert all(p.p.poll() is None for p in ranks), _logs(*ranks)
    finally:
        for p in procs:
            p.kill()


def test_a_second_node_with_a_live_nodes_id_or_an_unspecified_advertised_address_is_refused(redis_server, tmp_path):
    # a new-user trial: two nodes with --node-id dup both started and overwrote each other's
    # record (the node list named the wrong URL); a node on --host 0.0.0.0 advertised
    # http://0.0.0.0:PORT to the others
    procs: list[Proc] = []
    try:
        a = Node(tmp_path, "dup", redis_server.url, tmp_path / "ck")
        procs.append(a.proc)
        wait_for(lambda: _owner(a) == "dup", 10, "the first node to own the room")
        for extra, flag, why in (([], "--node-id", "a live node at"),
                                 (["--host", "0.0.0.0"], "--advertise-url", "needed with --host 0.0.0.0")):
            node_id = "dup" if not extra else "other"
            p = Proc(["serve", "--port", "0", "--room", ROOM, "--redis", redis_server.url, "--node-id", node_id,
                      "--checkpoint-dir", str(tmp_path / "ck"), *extra], tmp_path / f"serve-{node_id}.log")
            procs.append(p)
            assert p.p.wait(60) == 2, p.text()
            assert f"configuration error: {flag}" in p.text() and why in p.text(), p.text()
    finally:
        for p in procs:
            p.kill()


def test_a_room_no_node_ever_held_trains_at_once_without_a_roll_call(redis_server, tmp_path):
    # a new-user trial: a fresh cluster room (empty Redis, empty checkpoint directory) held its
    # first ranks 27 s in a roll call for ranks of a previous owner that never existed, and every
    # message gave another reason. With a 60 s roll call, training must start well before it ends.
    procs: list[Proc] = []
    try:
        a = Node(tmp_path, "A", redis_server.url, tmp_path / "shared-ckpt", "--roll-call", "60", "--grace", "60")
        procs.append(a.proc)
        wait_for(lambda: _owner(a) == "A", 10, "node A to own the room")
        t0 = time.monotonic()
        procs.append(_rank(tmp_path, a.url, 1))
        # (it waited about 30 s: the rank's side of the roll call ends there; the bound leaves
        # room for a loaded machine's rank start-up, 1-3 s here)
        wait_for(lambda: a.state()["step"] >= 5, 20, f"the first steps, not after a roll call\n{_logs(*procs)}")
        assert time.monotonic() - t0 < 20
    finally:
        for p in procs:
            p.kill()
