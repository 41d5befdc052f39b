"""Ctrl-C on the tabs-only demo (``RANKS=0 bash scripts/demo.sh``): the server's ordered stop tells
the tab to stop, its leader uploads the final checkpoint, and only then does the server exit.

(A new-user trial: the demo's cleanup sent the server SIGTERM at once when it had no native ranks
to wait for, a second signal after the terminal's SIGINT, so the server stopped at once and the
final checkpoint was lost: the newest stored was a periodic one, 1,264 to 3,200 steps older.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.integration.conftest import ROOT, _env
from tests.integration.test_stop import _ckpt

from .conftest import wait_for, wait_tab

pytestmark = pytest.mark.browser


def test_ctrl_c_on_the_tabs_only_demo_keeps_the_final_checkpoint(tmp_path, tabs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ckdir = tmp_path / "ckpt"
    env = _env() | {"PORT": str(port), "CKPT": str(ckdir), "INSTALL": "0", "PYTHON": sys.executable,
                    "RANKS": "0", "FRESH": "1"}
    log = open(tmp_path / "demo.log", "wb")
    demo = subprocess.Popen(["bash", str(ROOT / "scripts" / "demo.sh")], stdout=log, stderr=subprocess.STDOUT,
                            env=env, cwd=str(ROOT), start_new_session=True)   # its own process group
    text = lambda: (tmp_path / "demo.log").read_text(errors="replace")  # noqa: E731
    try:
        wait_for(lambda: "Open http://" in text(), 60, "the demo's URL")
        tab = tabs(f"http://127.0.0.1:{port}", "?room=digits")
        wait_tab(tab, lambda st: st["ready"] and st["step"] >= 50, 120, "the tab training alone")
        wait_for(lambda: (m := _ckpt(ckdir)) and m["step"] > 0, 60, "a periodic checkpoint")
        os.killpg(demo.pid, signal.SIGINT)               # Ctrl-C: SIGINT to the whole group
        assert demo.wait(60) in (0, 130), text()[-4000:]
        stopped = tab.state()       # (the server is gone: the page's own state, as it stopped)
        assert stopped is not None and not stopped["running"], stopped
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
        log.close()
    meta = _ckpt(ckdir)
    assert meta is not None and meta["final"] is True, (meta, text()[-3000:])
    assert meta["step"] == stopped["step"], (meta, stopped["step"])
    assert f"final checkpoint: step {meta['step']}" in text(), text()[-2000:]
