"""A server restarted while its ranks train (SIGTERM, then the same port and checkpoint
directory) leaves one lineage: the ranks resume their ids one by one, and the first one back
must not take the others, still on their way or training over their direct paths, for gone
(docs/PROTOCOL.md "Membership and majority", the roll call: a restarted server's is partial).
Found by a fault campaign: the first rank back led alone in a new term while the other two
trained on together, and at the merge one lineage lost thousands of steps (4 of 8 runs)."""

from __future__ import annotations

import math
import re
import socket
import threading
import urllib.parse

import pytest

from .conftest import wait_for

STEP = re.compile(r"^\[\s*[\d.]+s\] step\s+(\d+)\s", re.M)
RATE = re.compile(r"^\[\s*[\d.]+s\] step .*\(me\).*?([\d.]+) steps/s", re.M)


def _steps(text: str) -> list[int]:
    return [int(m) for m in STEP.findall(text)]


def _worst_rewind(steps: list[int]) -> int:
    top, worst = 0, 0
    for s in steps:
        top = max(top, s)
        worst = max(worst, top - s)
    return worst


@pytest.mark.timeout(300)
def test_ranks_keep_one_lineage_across_server_restarts(cluster, tmp_path):
    ckdir = str(tmp_path / "ck")
    # (reports every 0.5 s: a rank prints a progress line per report at most, so the 0.5 s lines
    # counted below were 1 s apart at the default --report-interval)
    url = cluster.serve("--checkpoint-dir", ckdir, "--report-interval", "0.5")
    port = str(urllib.parse.urlsplit(url).port)
    ranks = [cluster.rank("--print-every", "0.5") for _ in range(3)]
    wait_for(lambda: len(cluster.reports()) == 3 and all(r.get("cohort") == 3 for r in cluster.reports()),
             60, "a cohort of 3")
    for restart in range(3):
        n_lost = [r.text().count("link lost") for r in ranks]
        cluster.server.terminate()
        # the ranks notice, and train on over their direct paths meanwhile (a progress line after it)
        marks = wait_for(lambda: all(r.text().count("link lost") > n for r, n in zip(ranks, n_lost)) and
                         [len(_steps(r.text())) for r in ranks], 30, "every rank to lose its link")
        wait_for(lambda: all(len(_steps(r.text())) >= m + 2 for r, m in zip(ranks, marks)), 30,
                 "progress lines while the server is away")
        cluster.serve("--checkpoint-dir", ckdir, "--port", port, "--report-interval", "0.5")
        wait_for(lambda: sum(r["connected"] for r in cluster.state()["ranks"]) == 3, 60,
                 f"the 3 ranks back after restart {restart + 1}")
        marks = [len(_steps(r.text())) for r in ranks]
        wait_for(lambda: all(len(_steps(r.text())) >= m + 4 for r, m in zip(ranks, marks)), 30,
                 "progress after the ranks are back")
    cluster.post(f"/api/rooms/{cluster.room}/stop")
    for r in ranks:
        r.p.wait(60)
    finals = [re.findall(r"^stopped \(.*\); step (\d+), digest (\w+)", r.text(), re.M) for r in ranks]
    rewinds = [_worst_rewind(_steps(r.text())) for r in ranks]
    # (no rank was killed: nothing a rank applied is ever given up; a few hundred steps would be
    # the bound after a leader's kill, a merged second lineage rewound thousands)
    assert max(rewinds) < 200, (rewinds, cluster.logs())
    assert all(f for f in finals) and len({f[-1] for f in finals}) == 1, finals


#: the ranks' report period (serve --report-interval, its default), and their progress lines'
REPORT_S = 1.0
#: progress lines after the loss was seen that span at least 2 s (past policy.drop, 1.6 s)
LINES_PAST_DROP = math.ceil(2.0 / REPORT_S) + 1


@pytest.mark.timeout(180)
def test_a_leader_whose_only_link_closed_commits_nothing_alone(cluster):
    # docs/PROTOCOL.md "Membership and majority", a rank's own lost link: three ranks on the relay
    # alone (--no-direct), the server killed. Before, the leader went on committing rounds that
    # no other rank received until their beats were policy.drop (1.6 s) old: thousands of steps
    # ahead of its followers (about 5,400 measured); now it stops within the round in flight
    cluster.serve("--report-interval", str(REPORT_S))
    ranks = [cluster.rank("--no-direct", "--print-every", str(REPORT_S)) for _ in range(3)]
    wait_for(lambda: len(cluster.reports()) == 3 and all(r.get("cohort") == 3 for r in cluster.reports()),
             60, "a cohort of 3")
    wait_for(lambda: all(len(_steps(r.text())) >= 3 for r in ranks), 30, "progress lines")
    cluster.server.kill()
    marks = wait_for(lambda: all("link lost" in r.text() for r in ranks) and [len(_steps(r.text())) for r in ranks],
                     30, "every rank to lose its link")
    # 2 s of progress lines after the loss: past policy.drop, when the old leader stopped at last
    # (a line every REPORT_S: the wait was once for 10 lines, 10 s; the line after 2 s is the
    # first past 2 s)
    wait_for(lambda: all(len(_steps(r.text())) >= m + LINES_PAST_DROP for r, m in zip(ranks, marks)), 30,
             "progress lines while the server is away")
    leader = [r for r in ranks if "(me)" in r.text().rsplit("link lost", 1)[0]]
    assert len(leader) == 1, [r.text()[-2000:] for r in ranks]
    last = {id(r): max(_steps(r.text())) for r in ranks}
    ahead = last[id(leader[0])] - max(v for k, v in last.items() if k != id(leader[0]))
    # the bound is time, not steps: what the leader commits in 0.25 s at its own rate before the
    # loss (before the rule it went on for policy.drop, 1.6 s: 2,759-5,400 steps); at least 300
    # (CI saw 351 under load; 47 measured on an idle machine)
    rate = max([float(x) for x in RATE.findall(leader[0].text().rsplit("link lost", 1)[0])] or [0.0])
    assert ahead < max(300, 0.25 * rate), (ahead, rate, last)


class _Gate:
    """A TCP forwarder to ``127.0.0.1:target`` on a port of its own, which can be shut (every
    connection closed, new ones refused) and opened again on the same port: the ranks behind it
    are kept from reconnecting for as long as a test needs, whatever their backoff draws."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = 0
        self._lsock: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.open()

    def open(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self.port = s.getsockname()[1]
        self._lsock = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def shut(self) -> None:
        s, self._lsock = self._lsock, None
        if s is not None:
            s.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept(self, s: socket.socket) -> None:
        while True:
            try:
                a, _ = s.accept()
            except OSError:
                return                                  # shut
            try:
                b = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                a.close()                               # (the server is away: refused as it would be)
                continue
            b.settimeout(None)
            with self._lock:
                self._conns += [a, b]
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(x, y), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for c in (src, dst):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.mark.timeout(300)
def test_a_rank_joining_a_restarted_server_before_its_ranks_are_back_follows_them(cluster, tmp_path):
    # Found by a fault campaign (--no-direct, 1 of 4 runs): a new rank that joined a restarted
    # server before the room's ranks were back heard nobody, bootstrapped a term above its
    # checkpoint's and the server took it for the leader (the real leader's upload: 403); when the
    # ranks came back its term won and the cohort rewound to it. The ranks here reach the server
    # through a gate held shut until the new rank has joined, so it is alone in the partial window
    # whatever their reconnect backoff draws (docs/PROTOCOL.md "Joining": no bootstrap while the
    # roll call is partial)
    ckdir = str(tmp_path / "ck")
    # (a checkpoint a second: the one waited for below came after the default 5 s)
    ckpt_every = ("--checkpoint-interval", "1")
    url = cluster.serve("--checkpoint-dir", ckdir, *ckpt_every)
    port = urllib.parse.urlsplit(url).port
    gate = _Gate(port)
    try:
        direct_url = cluster.url
        cluster.url = f"http://127.0.0.1:{gate.port}"
        ranks = [cluster.rank("--no-direct", "--print-every", "0.5") for _ in range(3)]
        cluster.url = direct_url
        wait_for(lambda: len(cluster.reports()) == 3 and all(r.get("cohort") == 3 for r in cluster.reports()),
                 90, "a cohort of 3")
        # a checkpoint in the leader's term: the joiner's term floor, so its bootstrap would win
        wait_for(lambda: (cluster.state().get("checkpoint") or {}).get("step"), 60, "a checkpoint")
        n_lost = [r.text().count("link lost") for r in ranks]
        cluster.server.terminate()
        wait_for(lambda: all(r.text().count("link lost") > n for r, n in zip(ranks, n_lost)), 30,
                 "every rank to lose its link")
        gate.shut()
        cluster.serve("--checkpoint-dir", ckdir, "--port", str(port), *ckpt_every)
        new = cluster.rank("--no-direct", "--print-every", "0.5")
        # alone in the room for 4 progress lines (one a report, every 1 s) after it joined, where a
        # bootstrap takes two 400 ms beats; then the gate opens, well within the ranks' 30 s
        # reconnect bound from their link's loss
        wait_for(lambda: "joined room" in new.text(), 60, "the new rank to join")
        wait_for(lambda: len(_steps(new.text())) >= 4, 20,
                 "the new rank's progress lines while the others are away")
        gate.open()
        wait_for(lambda: sum(r["connected"] for r in cluster.state()["ranks"]) == 4, 60, "the 3 ranks back")
        wait_for(lambda: len(cluster.reports()) == 4 and all(r.get("cohort") == 4 for r in cluster.reports()),
                 60, "a cohort of 4")
        marks = [len(_steps(r.text())) for r in ranks + [new]]
        wait_for(lambda: all(len(_steps(r.text())) >= m + 4 for r, m in zip(ranks + [new], marks)), 30,
                 "progress after the ranks are back")
        cluster.post(f"/api/rooms/{cluster.room}/stop")
        for r in ranks + [new]:
            r.p.wait(60)
    finally:
        gate.shut()
    led = [ln for ln in new.text().splitlines() if "(me)" in ln]
    assert not led, (led[:3], cluster.logs())
    refused = [ln for r in ranks + [new] for ln in r.text().splitlines() if "HTTP 403" in ln]
    assert not refused, (refused, cluster.logs())
    rewinds = [_worst_rewind(_steps(r.text())) for r in ranks]
    assert max(rewinds) < 200, (rewinds, cluster.logs())
    finals = [re.findall(r"^stopped \(.*\); step (\d+), digest (\w+)", r.text(), re.M) for r in ranks + [new]]
    assert all(f for f in finals) and len({f[-1] for f in finals}) == 1, finals
