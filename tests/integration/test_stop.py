"""How a run ends, as a user sees it: `--steps` is an exact limit, and a stop (Ctrl-C on
scripts/demo.sh, SIGINT to `tabcohort serve`, a terminal that hangs up) is ordered: the ranks stop, the leader uploads the
final checkpoint, then the server exits. (SIGTERM, a restart, leaves the ranks training:
tests/integration/test_robustness.py.)"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import types

import pytest

from tabcohort_server.serve import _say_final_checkpoint

from .conftest import ROOT, _env, wait_for

pytestmark = pytest.mark.integration


def _ckpt(directory: pathlib.Path, room: str = "digits") -> dict | None:
    from tabcohort_server import checkpoint as ck
    got = ck.load(str(directory), room)
    return None if got is None else got[0]


def _stopped_step(text: str) -> int:
    m = re.findall(r"stopped \(.*\); step (\d+), digest", text)
    assert m, text[-3000:]
    return int(m[-1])


def test_serve_steps_is_an_exact_limit_and_the_final_checkpoint_is_at_it(cluster):
    # `serve --steps 300` with two native ranks ended at 682 and 1494 in two runs: the server
    # checked the limit on state reports, about once a second; the leader now stops at it
    ckdir = cluster.tmp / "ckpt"
    cluster.serve("--steps", "30", "--checkpoint-dir", str(ckdir))
    ranks = [cluster.rank(), cluster.rank()]
    for p in ranks:
        assert p.p.wait(90) == 0, p.text()[-3000:]
    meta = wait_for(lambda: (m := _ckpt(ckdir)) and m.get("final") and m, 10, "the final checkpoint")
    assert meta["step"] == 30, meta
    assert [_stopped_step(p.text()) for p in ranks] == [30, 30]
    # a run shorter than --print-every printed no line while it ran: its stop line said "cohort 0"
    # beside the rank's share (a new-user trial); it says the cohort the rank trained in
    for p in ranks:
        lines = [x for x in p.text().splitlines() if re.search(r"\] step +30 ", x)]
        assert lines and re.search(r"cohort 2\b", lines[-1]), p.text()[-3000:]
    st = cluster.state()
    assert st["stopped"] and st["step"] == 30 and st["checkpoint"]["step"] == 30, st
    # the server says so too (it printed nothing when the room reached its limit), once
    said = "tabcohort serve: room digits reached its step limit (--steps 30) at step 30"
    wait_for(lambda: said in cluster.server.text(), 10, "the server's step-limit line")
    assert cluster.server.text().count("reached its step limit") == 1, cluster.server.text()
    # ... and the final checkpoint when it is stored (it said so only on Ctrl-C), once
    wait_for(lambda: "room digits: final checkpoint at step 30" in cluster.server.text(), 10,
             "the server's final-checkpoint line")
    assert cluster.server.text().count("final checkpoint at step") == 1, cluster.server.text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ctrl_c_on_the_demo_stops_in_order_and_leaves_the_final_checkpoint(tmp_path):
    # a new user's Ctrl-C lost the final checkpoint twice: server and ranks stopped at once and
    # the leader's upload failed (ClientConnectorError); only a periodic one, 300 steps older, stayed
    ckdir = tmp_path / "ckpt"
    port = _free_port()
    env = _env() | {"PORT": str(port), "CKPT": str(ckdir), "INSTALL": "0", "PYTHON": sys.executable,
                    "RANKS": "2"}
    log = open(tmp_path / "demo.log", "wb")
    demo = subprocess.Popen(["bash", str(ROOT / "scripts" / "demo.sh")], stdout=log, stderr=subprocess.STDOUT,
                            env=env, cwd=str(ROOT), start_new_session=True)   # its own process group
    text = lambda: (tmp_path / "demo.log").read_text(errors="replace")  # noqa: E731
    try:
        head = wait_for(lambda: "Open http://" in text() and text(), 60, "the demo's URL")
        lines_before_url = head[:head.index("Open http://")].count("\n")
        assert lines_before_url <= 24, head              # the first screen fits a terminal
        # training, and a periodic checkpoint stored (so a final one is told apart from it)
        wait_for(lambda: (m := _ckpt(ckdir)) and m["step"] > 0, 60, "a periodic checkpoint")
        os.killpg(demo.pid, signal.SIGINT)               # Ctrl-C: SIGINT to the whole group
        assert demo.wait(60) in (0, 130), text()[-4000:]
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
        log.close()
    out = text()
    meta = _ckpt(ckdir)
    assert meta is not None and meta["final"] is True, (meta, out[-4000:])
    steps = [int(s) for s in re.findall(r"\[rank \d\] stopped \(.*\); step (\d+),", out)]
    assert len(steps) == 2 and meta["step"] == max(steps), (meta, steps, out[-4000:])
    assert "checkpoint upload failed" not in out, out[-4000:]
    assert f"final checkpoint: step {meta['step']}" in out, out[-2000:]


def test_sigint_to_the_server_alone_stops_its_ranks_first_and_keeps_their_final_checkpoint(cluster):
    ckdir = cluster.tmp / "ckpt"
    cluster.serve("--checkpoint-dir", str(ckdir))
    ranks = [cluster.rank(), cluster.rank()]
    wait_for(lambda: (s := cluster.state())["step"] >= 30 and s["n_connected"] == 2, 60, "2 ranks training")
    cluster.server.p.send_signal(signal.SIGINT)
    for p in ranks:
        assert p.p.wait(30) == 0, p.text()[-3000:]
        assert "server: the server is shutting down" in p.text()
    assert cluster.server.p.wait(30) == 0, cluster.server.text()
    meta = _ckpt(ckdir)
    assert meta is not None and meta["final"] is True, meta
    assert meta["step"] == max(_stopped_step(p.text()) for p in ranks), meta
    assert f"final checkpoint at step {meta['step']}" in cluster.server.text()
    # the console said the ranks came and went (it said nothing: a new-user trial)
    text = cluster.server.text()
    assert "joined (may lead; 2 connected)" in text and re.search(r"rank [0-9a-f]{8} left \(0 connected\)", text), text


def test_the_demo_refuses_a_port_something_else_listens_on(tmp_path):
    # another server on PORT answered the demo's health check: it printed its URL, started ranks
    # that joined the other server (and failed on its trainer token) and exited 0
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        port = other.getsockname()[1]
        env = _env() | {"PORT": str(port), "CKPT": str(tmp_path / "ckpt"), "INSTALL": "0",
                        "PYTHON": sys.executable}
        p = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], env=env, cwd=str(ROOT),
                           capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and f"PORT={port}" in p.stderr and "already listens" in p.stderr, (p.stdout, p.stderr)
    assert "Open http://" not in p.stdout and "[rank" not in p.stdout
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], env=env | {"INSTALL": "maybe"},
                         cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "INSTALL='maybe'" in bad.stderr, bad.stderr


def test_a_follower_stopped_alone_leaves_at_once_while_the_leader_trains_on(cluster):
    # its own Ctrl-C took 5.2 s every time: it waited for a publication from a leader that was
    # not stopping (the wait is for a room that stops)
    cluster.serve()
    ranks = [cluster.rank(), cluster.rank(), cluster.rank()]
    st = wait_for(lambda: (s := cluster.state())["step"] >= 50 and s["n_connected"] == 3 and s, 60, "3 ranks training")
    leader = st["leader"]
    # a rank that is not the leader, by the id its log says it joined with (the room's reports
    # may not all be in yet: picking from them raised StopIteration in a loaded CI run)
    follower = next(p for p in ranks if "joined room" in p.text() and f"rank {leader:08x} joined" not in p.text())
    t0 = time.monotonic()
    follower.p.send_signal(signal.SIGINT)
    assert follower.p.wait(30) == 0, follower.text()[-2000:]
    took = time.monotonic() - t0
    assert took < 3.0, took
    step = cluster.state()["step"]
    wait_for(lambda: cluster.state()["step"] >= step + 50, 30, "the others to train on")
    print(f"\na follower's own SIGINT: exited in {took:.2f} s")


def test_a_leader_that_left_a_room_training_on_is_not_said_to_have_stored_the_final_checkpoint():
    # a new-user trial: Ctrl-C on the leader rank alone printed "final checkpoint at step 82294"
    # while the room trained on; the real final one, later, was never said
    room = types.SimpleNamespace(name="digits", stopped=False, final_checkpoint_said=False,
                                 job=types.SimpleNamespace(steps=150000))
    out: list[str] = []
    _say_final_checkpoint(room, {"step": 82294}, out.append)
    assert out == ["tabcohort serve: room digits: checkpoint at step 82294, uploaded by its leader as it left; "
                   "the room has not stopped (a rank that may lead takes over, if one is connected)"]
    # at the step limit it is the final one even before the report that stops the room arrives
    at_limit = types.SimpleNamespace(name="d", stopped=False, final_checkpoint_said=False,
                                     job=types.SimpleNamespace(steps=30))
    _say_final_checkpoint(at_limit, {"step": 30}, out.append)
    assert out[-1] == "tabcohort serve: room d: final checkpoint at step 30"
    del out[-1]
    room.stopped = True
    _say_final_checkpoint(room, {"step": 142411}, out.append)
    _say_final_checkpoint(room, {"step": 142412}, out.append)       # said once
    assert out[1:] == ["tabcohort serve: room digits: final checkpoint at step 142411"]


def _serve_started(port: int) -> bool:
    """Whether a `tabcohort serve --port PORT` process exists (read from /proc)."""
    for d in pathlib.Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in cmd and str(port).encode() in cmd:
            return True
    return False


def test_ctrl_c_while_the_demo_starts_stops_it_at_once(tmp_path):
    # a new-user trial: a Ctrl-C before the server answered was lost on it (a background job of
    # the script starts with SIGINT ignored, and its own handler was not installed yet); the demo
    # waited out its 15 s bound, the server printed its ready banner after "stopping"
    port = _free_port()
    env = _env() | {"PORT": str(port), "CKPT": str(tmp_path / "ckpt"), "INSTALL": "0", "PYTHON": sys.executable,
                    "RANKS": "2"}
    log = open(tmp_path / "demo.log", "wb")
    demo = subprocess.Popen(["bash", str(ROOT / "scripts" / "demo.sh")], stdout=log, stderr=subprocess.STDOUT,
                            env=env, cwd=str(ROOT), start_new_session=True)
    text = lambda: (tmp_path / "demo.log").read_text(errors="replace")  # noqa: E731
    try:
        wait_for(lambda: _serve_started(port), 30, "the demo's server process")
        t0 = time.monotonic()
        os.killpg(demo.pid, signal.SIGINT)
        # (60 s: once the server answered, the stop is the ordered one, whose waits the demo bounds
        # at 20 s for the ranks, then 15 + 5 s for the server; 30 s ran out once in CI's integration
        # tier; the case this test is about, a Ctrl-C before the server answered, is held to 8 s below)
        try:
            rc = demo.wait(60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the demo did not stop within 60 s of Ctrl-C:\n{text()[-3000:]}") from None
        assert rc in (0, 130), text()[-3000:]
        took_s = time.monotonic() - t0
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
        log.close()
    out = text()
    assert "[demo] stopping" in out, out[-3000:]
    # (the demo prints its URL once the server answered: without it, the Ctrl-C came before, the
    # case this is about; a slow test process can send it later, and the ordered stop follows)
    if "Open http://" not in out:
        assert took_s < 8, (took_s, out[-3000:])
        assert "the server did not start" not in out, out[-3000:]
    assert not _serve_started(port), "the demo left its server running"


def test_a_demo_whose_output_is_closed_stops_its_server_and_ranks(tmp_path):
    # a new-user trial: `demo.sh | head -n 6` ended the demo on SIGPIPE and left its server
    # running (the next run found the port in use and the checkpoint directory locked)
    port = _free_port()
    env = _env() | {"PORT": str(port), "CKPT": str(tmp_path / "ckpt"), "INSTALL": "0", "PYTHON": sys.executable,
                    "RANKS": "2"}
    demo = subprocess.Popen(["bash", str(ROOT / "scripts" / "demo.sh")], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env, cwd=str(ROOT), start_new_session=True)
    try:
        lines = [demo.stdout.readline() for _ in range(3)]    # the reader reads a few lines, then goes
        demo.stdout.close()
        assert all(lines), lines
        assert demo.wait(60) == 141
        wait_for(lambda: not _serve_started(port), 30, "the demo's server to be stopped")
    finally:
        try:   # (the whole group: what a failed run left behind too)
            os.killpg(demo.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _Terminal:
    """A process whose controlling terminal is a pseudo-terminal this test holds (as a command
    typed in an ssh session); :meth:`hang_up` closes it, as a dropped session does: the kernel
    sends the process SIGHUP, and its writes to the terminal fail from then on."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        import fcntl
        import termios
        import threading
        self.master, slave = os.openpty()
        self.p = subprocess.Popen([sys.executable, "-m", "tabcohort.cli", *args], stdin=slave, stdout=slave,
                                  stderr=slave, env={**_env(), **(env or {})}, cwd=str(ROOT), start_new_session=True,
                                  preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)
        self.out = bytearray()
        self._open = True
        self._reader = threading.Thread(target=self._read, daemon=True)   # (a full terminal blocks its writer)
        self._reader.start()

    def _read(self) -> None:
        import select
        while self._open:
            if select.select([self.master], [], [], 0.05)[0]:
                try:
                    self.out += os.read(self.master, 65536)
                except OSError:
                    return

    def text(self) -> str:
        return self.out.decode(errors="replace")

    def hang_up(self) -> None:
        self._open = False
        self._reader.join(5)
        os.close(self.master)


def test_a_hung_up_terminal_stops_the_server_in_order_and_keeps_the_final_checkpoint(cluster):
    """SIGHUP (an ssh session that dropped) is Ctrl-C's ordered stop for `serve`: the ranks stop,
    the final checkpoint is stored, the server exits 0, though it can no longer print (it died
    at once, and the training's end was lost)."""
    ckdir = cluster.tmp / "ckpt"
    term = _Terminal(["serve", "--port", "0", "--room", cluster.room, "--operator-token", cluster.operator_token,
                      "--trainer-token", cluster.trainer_token, "--checkpoint-dir", str(ckdir)])
    try:
        cluster.url = wait_for(lambda: (m := re.search(r"^URL (\S+)", term.text(), re.M)) and m[1], 30,
                               "the server URL on its terminal")
        ranks = [cluster.rank(), cluster.rank()]
        wait_for(lambda: (s := cluster.state())["step"] >= 30 and s["n_connected"] == 2, 60, "2 ranks training")
        term.hang_up()
        # the demo's trap passes the hangup on as SIGINT at once: the same stop, not "at once"
        # (it stopped the server before the final checkpoint: a review)
        term.p.send_signal(signal.SIGINT)
        for p in ranks:
            assert p.p.wait(30) == 0, p.text()[-3000:]
            assert "server: the server is shutting down" in p.text()
        assert term.p.wait(30) == 0, term.text()
    finally:
        if term.p.poll() is None:
            term.p.kill()
    meta = _ckpt(ckdir)
    assert meta is not None and meta["final"] is True, meta
    assert meta["step"] == max(_stopped_step(p.text()) for p in ranks), meta


def test_a_hung_up_terminal_stops_a_leading_rank_in_order(cluster):
    """SIGHUP is a rank's ordered stop too: a leader alone publishes and uploads its last model,
    and exits 0, printing nothing more (it died mid-round, its training since the last periodic
    checkpoint lost)."""
    cluster.serve("--checkpoint-interval", "3600")
    term = _Terminal(["rank", "--server", cluster.url, "--room", cluster.room],
                     env={"TABCOHORT_TRAINER_TOKEN": cluster.trainer_token})
    try:
        wait_for(lambda: cluster.state()["step"] >= 30, 60, "the rank training")
        assert cluster.state()["checkpoint"] is None
        term.hang_up()
        assert term.p.wait(30) == 0, term.text()
    finally:
        if term.p.poll() is None:
            term.p.kill()
    ck = wait_for(lambda: cluster.state()["checkpoint"], 10, "the rank's last checkpoint")
    assert ck["step"] >= 30, ck
    assert "uploaded by its leader as it left" in cluster.server.text() or "final checkpoint" in cluster.server.text()


def test_a_rank_whose_output_is_closed_stops_in_order(cluster):
    """`tabcohort rank ... | head`: the reader leaves (EPIPE on the next line) and the rank takes
    it as a hangup, the ordered stop: a leader uploads its last model and exits 0 (a printing
    error crashed it mid-round, a traceback and the training since the last checkpoint lost)."""
    cluster.serve("--checkpoint-interval", "3600")
    p = subprocess.Popen([sys.executable, "-m", "tabcohort.cli", "rank", "--server", cluster.url, "--room", cluster.room,
                          "--print-every", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**_env(), "TABCOHORT_TRAINER_TOKEN": cluster.trainer_token}, cwd=str(ROOT))
    try:
        wait_for(lambda: cluster.state()["step"] >= 30, 60, "the rank training")
        p.stdout.readline()
        p.stdout.close()                                  # (as head does after its lines)
        assert p.wait(30) == 0
        # why it stopped is said: "SIGHUP: stopping in order" alone read as a hangup never sent
        err = p.stderr.read().decode()
        assert "standard output is gone, its reader left (a closed pipe): stopping as on a hangup" in err, err
    finally:
        if p.poll() is None:
            p.kill()
    ck = wait_for(lambda: cluster.state()["checkpoint"], 10, "the rank's last checkpoint")
    assert ck["step"] >= 30, ck
