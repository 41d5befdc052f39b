"""A server restarted while its ranks train (SIGTERM, then the same port and checkpoint
directory) leaves one lineage: the ranks resume their ids one by one, and the first one back
must not take the others, still on their way or training over their direct paths, for gone
(docs/PROTOCOL.md "Membership and majority", the roll call: a restarted server's is partial).
Found by a fault campaign: the first rank back led alone in a new term while the other two
trained on together, and at the merge one lineage lost thousands of steps (4 of 8 runs)."""

from __future__ import annotations

import re
import urllib.parse

import pytest

from .conftest import wait_for

STEP = re.compile(r"^\[\s*[\d.]+s\] step\s+(\d+)\s", re.M)


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
    url = cluster.serve("--checkpoint-dir", ckdir)
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
        cluster.serve("--checkpoint-dir", ckdir, "--port", port)
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


@pytest.mark.timeout(180)
def test_a_leader_whose_only_link_closed_commits_nothing_alone(cluster):
    # docs/PROTOCOL.md "Membership and majority", a rank's own lost link: three ranks on the relay
    # alone (--no-direct), the server killed. Before, the leader went on committing rounds that
    # no other rank received until their beats were policy.drop (1.6 s) old: thousands of steps
    # ahead of its followers (about 5,400 measured); now it stops within the round in flight
    cluster.serve()
    ranks = [cluster.rank("--no-direct", "--print-every", "0.2") for _ in range(3)]
    wait_for(lambda: len(cluster.reports()) == 3 and all(r.get("cohort") == 3 for r in cluster.reports()),
             60, "a cohort of 3")
    wait_for(lambda: all(len(_steps(r.text())) >= 3 for r in ranks), 30, "progress lines")
    cluster.server.kill()
    marks = wait_for(lambda: all("link lost" in r.text() for r in ranks) and [len(_steps(r.text())) for r in ranks],
                     30, "every rank to lose its link")
    # 2 s of progress lines after the loss: past policy.drop, when the old leader stopped at last
    wait_for(lambda: all(len(_steps(r.text())) >= m + 10 for r, m in zip(ranks, marks)), 30,
             "progress lines while the server is away")
    leader = [r for r in ranks if "(me)" in r.text().rsplit("link lost", 1)[0]]
    assert len(leader) == 1, [r.text()[-2000:] for r in ranks]
    last = {id(r): max(_steps(r.text())) for r in ranks}
    ahead = last[id(leader[0])] - max(v for k, v in last.items() if k != id(leader[0]))
    assert ahead < 300, (ahead, last)
