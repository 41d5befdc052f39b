"""Ctrl-C during ``tabcohort simulate`` (without ``--json``): one line saying where the run was
stopped (step, the last held-out accuracy when one is known, elapsed seconds), then exit 130;
it printed nothing (``--json`` prints its one document: cli.main's handler)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from tabcohort.cli import interrupted_line


def test_the_interrupted_line_says_the_step_the_accuracy_when_known_and_the_seconds():
    assert interrupted_line(42, 0.9123, 3.04) == "stopped by Ctrl-C at step 42, last test accuracy 91.23 %, after 3.0 s"
    assert interrupted_line(0, None, 0.25) == "stopped by Ctrl-C at step 0, no test accuracy yet, after 0.2 s"
    assert interrupted_line(None, None, 1.0) == "stopped by Ctrl-C before the ranks started, after 1.0 s"
    assert interrupted_line(7, float("nan"), 1.0) == "stopped by Ctrl-C at step 7, no test accuracy yet, after 1.0 s"


def test_ctrl_c_during_simulate_prints_one_line_and_exits_130():
    if sys.platform == "emscripten":
        pytest.skip("a subprocess: native tiers only")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # (SIGINT as a terminal leaves it: a shell that starts CI in the background ignores it)
    p = subprocess.Popen([sys.executable, "-m", "tabcohort", "simulate", "--ranks", "2", "--dataset", "synthetic",
                          "--steps", "1000000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    watchdog = threading.Timer(60, p.kill)     # (a run that never prints progress fails, not hangs)
    watchdog.start()
    try:
        for line in p.stdout:
            if "] step" in line:               # its first progress line: the ranks are running
                break
        os.kill(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        watchdog.cancel()
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 130, (p.returncode, out, err[-2000:])
    last = out.strip().splitlines()[-1] if out.strip() else ""
    assert last.startswith("stopped by Ctrl-C at step ") and last.endswith(" s"), (out, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
