"""scripts/demo.sh's settings as a new user gets them wrong: each is refused with one `[demo]`
line and a nonzero exit before anything is deleted or started, and what it says at the end is
true."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from .conftest import ROOT, _env

pytestmark = pytest.mark.integration
DEMO = str(ROOT / "scripts" / "demo.sh")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _demo(env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the demo to its end; on a timeout its whole process group is killed (its server and
    ranks too) and the test fails."""
    p = subprocess.Popen(["bash", DEMO], env=_env() | {"INSTALL": "0", "PYTHON": sys.executable} | env,
                         cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"the demo did not end within {timeout} s:\n{out[-3000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _old_checkpoint(ckdir: pathlib.Path) -> list[pathlib.Path]:
    ckdir.mkdir(parents=True, exist_ok=True)
    (ckdir / "digits.history").mkdir(exist_ok=True)
    files = [ckdir / "digits.ckpt", ckdir / "digits.history" / "step-00000000000000000090-000000000000.ckpt"]
    for f in files:
        f.write_bytes(b"the previous run's checkpoint")
    return files


def test_a_second_demo_on_a_checkpoint_directory_in_use_deletes_nothing(tmp_path):
    # a new-user trial: a second demo from the same checkout removed the running one's checkpoint
    # ("fresh start"), then its server refused the directory, and it reported the other's checkpoint
    from tabcohort_server.serve import lock_checkpoint_dir

    ckdir = tmp_path / "ckpt"
    old = _old_checkpoint(ckdir)
    held = lock_checkpoint_dir(str(ckdir))        # as a running server holds it
    try:
        r = _demo({"CKPT": str(ckdir), "PORT": str(_free_port())})
    finally:
        held.close()
    assert r.returncode == 1 and f"another tabcohort serve (pid {os.getpid()}) uses this directory" in r.stderr, \
        (r.stdout, r.stderr)
    assert "[server]" not in r.stdout and "checkpoint:" not in r.stdout, r.stdout
    assert all(f.exists() for f in old), "the running server's checkpoint was deleted"


@pytest.mark.parametrize("env,said", [
    # (PORT=0 hung: serve bound a free port and the ranks dialled port 0)
    pytest.param({"PORT": "0"}, "[demo] PORT=0: the demo needs a fixed port", id="port0"),
    # (PORT=70000 printed a Python traceback, OverflowError from connect_ex, before the clear error)
    ({"PORT": "70000"}, "[demo] PORT=70000: expected a port in 1..65535"),
    ({"PORT": "99999999999999999999999"}, "expected a port in 1..65535"),
    # (PYTHON=nonexistent deleted the previous run's checkpoint, then failed with shell errors)
    ({"PYTHON": "tabcohort-no-such-python"}, "[demo] PYTHON=tabcohort-no-such-python: no such command"),
    ({"PYTHON": "true"}, "[demo] PYTHON=true: not a Python 3.11+ interpreter"),
    # (PORT=08091 printed a Python SyntaxError and skipped the port-in-use check; HOST=999.9.9.9
    # deleted the previous run's checkpoint, then the server refused the address)
    ({"PORT": "08091"}, "[demo] PORT='08091': write it without leading zeros"),
    ({"HOST": "999.9.9.9"}, "[demo] HOST=999.9.9.9: not an address this machine can listen on"),
    ({"HOST": "192.0.2.1"}, "[demo] HOST=192.0.2.1: not an address this machine can listen on"),   # (TEST-NET-1)
    ({"SERVER_WAIT": "0"}, "[demo] SERVER_WAIT=0: expected at least 1 (seconds)"),
    ({"SERVER_WAIT": "2.5"}, "[demo] SERVER_WAIT='2.5': expected a whole number"),
    # (a bare "mkdir: cannot create directory" from the shell)
    ({"CKPT": "/proc/tabcohort-no-such-dir"}, "[demo] CKPT=/proc/tabcohort-no-such-dir: cannot create or write"),
])
def test_bad_settings_are_refused_before_anything_is_deleted_or_started(tmp_path, env, said):
    ckdir = tmp_path / "ckpt"
    old = _old_checkpoint(ckdir)
    r = _demo({"CKPT": str(ckdir), "PORT": str(_free_port())} | env)
    assert r.returncode == 2 and said in r.stderr, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "command not found" not in r.stderr, r.stderr
    assert "[server]" not in r.stdout and "Open http://" not in r.stdout, r.stdout
    assert all(f.exists() for f in old), "the previous run's checkpoint was deleted"


def test_a_server_that_never_answers_stops_the_demo_with_a_clear_error(tmp_path):
    # the health check fell through after 20 s and started the ranks anyway
    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/bin/sh\n"
        "# a serve that starts and never answers; everything else is the real interpreter\n"
        f'if [ "$1 $2 $3" = "-m tabcohort serve" ]; then exec {sys.executable} -c '
        "'import signal, sys, time; signal.signal(signal.SIGINT, lambda *a: sys.exit(0)); time.sleep(120)'; fi\n"
        f'exec {sys.executable} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    t0 = time.monotonic()
    # (SERVER_WAIT: the bound the demo waits for the server, 20 s by default, which the test
    # waited out whole)
    r = _demo({"CKPT": str(tmp_path / "ckpt"), "PORT": str(_free_port()), "PYTHON": str(wrapper),
               "SERVER_WAIT": "3"}, timeout=120)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "[demo] the server did not answer" in r.stderr and "within 3 s" in r.stderr, r.stderr
    assert "[rank" not in r.stdout and "Open http://" not in r.stdout, r.stdout
    assert time.monotonic() - t0 < 60


def test_a_checkpoint_already_past_steps_is_said_so_not_that_the_room_reached_it(tmp_path):
    # FRESH=0 STEPS=500 on a checkpoint at step 90000 said "the room reached its step limit (500)"
    ckdir = tmp_path / "ckpt"
    env = {"CKPT": str(ckdir), "RANKS": "1"}
    first = _demo(env | {"PORT": str(_free_port()), "STEPS": "20"}, timeout=180)
    assert first.returncode == 0 and "[demo] the room reached its step limit (20)" in first.stdout, first.stdout[-3000:]
    again = _demo(env | {"PORT": str(_free_port()), "STEPS": "10", "FRESH": "0"}, timeout=180)
    assert again.returncode == 0, (again.stdout[-3000:], again.stderr)
    assert "resuming from" in again.stdout and "(step 20)" in again.stdout, again.stdout[-3000:]
    assert "reached its step limit" not in again.stdout, again.stdout[-3000:]
    assert ("[demo] nothing to train: the checkpoint was already at step 20, at or past the step limit (STEPS=10)"
            in again.stdout), again.stdout[-3000:]
    # (no rank trained, so none uploads: the stop line told of a final upload that never came)
    for out in (first.stdout, again.stdout):
        assert "[demo] stopping the server" in out and "the leader uploads" not in out, out[-3000:]
