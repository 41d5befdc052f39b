"""Integration tier: real sockets and processes on loopback. Helpers to start ``tabcohort serve``
and ``tabcohort rank`` as subprocesses and to wait on the server's JSON with a bound."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any, Callable

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
try:
    import tabcohort_server  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "server"))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "client_py"), str(ROOT / "server"),
                                         env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    for k in ("TABCOHORT_SERVER", "TABCOHORT_ROOM", "TABCOHORT_TOKEN", "TABCOHORT_BATCH", "TABCOHORT_LINK",
              "TABCOHORT_OPERATOR_TOKEN", "TABCOHORT_TRAINER_TOKEN",
              "TABCOHORT_DISCOVER", "TABCOHORT_DISCOVER_HOST", "TABCOHORT_DISCOVER_TIMEOUT",
              "TABCOHORT_DISCOVER_INTERFACES", "TABCOHORT_TRUST_JOB", "TABCOHORT_JOB", "TABCOHORT_DIRECT",
              "TABCOHORT_DIRECT_HOST", "TABCOHORT_DIRECT_ANNOUNCE"):
        env.pop(k, None)
    return env


class Proc:
    """A subprocess whose output goes to a log file (read it on failure)."""

    def __init__(self, args: list[str], log: pathlib.Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self.fh = open(log, "wb")
        self.p = subprocess.Popen([sys.executable, "-m", "tabcohort.cli", *args], stdout=self.fh,
                                  stderr=subprocess.STDOUT, env={**_env(), **(env or {})}, cwd=str(ROOT))

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)

    def terminate(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_for(cond: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    """Poll ``cond`` until truthy; fail with ``what`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


class Cluster:
    """One ``tabcohort serve`` and its ranks, all subprocesses on 127.0.0.1."""

    def __init__(self, tmp: pathlib.Path) -> None:
        self.tmp = tmp
        self.procs: list[Proc] = []
        self.server: Proc | None = None
        self.url = ""
        self.room = "digits"
        #: the operator token every serve gets here (state() and post() present it)
        self.operator_token = "operator-token-for-tests-0123"
        #: the trainer credential every serve gets here and every rank carries unless told not
        #: to (``rank(..., trainer=False)``: a volunteer that may only contribute)
        self.trainer_token = "trainer-token-for-tests-4567"

    def serve(self, *args: str) -> str:
        op = () if "--operator-token" in args else ("--operator-token", self.operator_token)
        tr = () if "--trainer-token" in args else ("--trainer-token", self.trainer_token)
        self.server = Proc(["serve", "--port", "0", "--room", self.room, *op, *tr, *args], self.tmp / "serve.log")
        self.procs.append(self.server)

        def url() -> str | None:
            for line in self.server.text().splitlines():
                if line.startswith("URL "):
                    return line.split()[1]
            if self.server.p.poll() is not None:
                raise AssertionError("serve exited:\n" + self.server.text())
            return None
        self.url = wait_for(url, 30, "the server URL")
        return self.url

    def rank(self, *args: str, trainer: bool = True) -> Proc:
        n = sum(1 for p in self.procs if p is not self.server)
        env = {"TABCOHORT_TRAINER_TOKEN": self.trainer_token} if trainer else None
        p = Proc(["rank", "--server", self.url, "--room", self.room, *args], self.tmp / f"rank{n}.log", env=env)
        self.procs.append(p)
        return p

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.operator_token}"}

    def state(self) -> dict:
        """The room as the operator sees it (``GET /api/rooms/ROOM`` with the operator token)."""
        req = urllib.request.Request(f"{self.url}/api/rooms/{self.room}", headers=self._auth())
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.load(r)

    def reports(self, connected_only: bool = True) -> list[dict]:
        return [r["report"] for r in self.state()["ranks"]
                if r["report"] and (r["connected"] or not connected_only)]

    def post(self, path: str) -> dict:
        req = urllib.request.Request(f"{self.url}{path}", data=b"", method="POST", headers=self._auth())
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.load(r)

    def logs(self) -> str:
        return "\n".join(f"--- {p.log.name}\n{p.text()[-3000:]}" for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            if p is not self.server:
                p.kill()
        if self.server is not None:
            self.server.terminate()
        for p in self.procs:
            p.fh.close()


@pytest.fixture
def cluster(tmp_path: pathlib.Path, request: pytest.FixtureRequest):
    c = Cluster(tmp_path)
    yield c
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        print(c.logs())
    c.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture(scope="session")
def baseline(tmp_path_factory):
    """The hostile-rank tests' clean run (``hostile_common.train`` without an attacker), trained
    once for both files that compare against it (test_hostile_protocol, test_hostile_server),
    and once for all pytest-xdist workers: the first to need it trains it under a file lock in
    their shared temporary directory and stores it there, the others read it (each worker
    trained its own: 30 s more of one worker's time)."""
    import fcntl
    import pickle
    from .hostile_common import STEPS, train
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent                         # (the workers' common directory)
    stored = root / "hostile-baseline.pickle"
    with open(root / "hostile-baseline.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)           # (released when the file closes)
        if stored.exists():
            return pickle.loads(stored.read_bytes())
        c = Cluster(tmp_path_factory.mktemp("baseline"))
        try:
            run = train(c, c.tmp / "ck")
        except BaseException:
            print(c.logs())
            raise
        finally:
            c.close()
        assert run["state"]["stop_reason"] == f"steps {STEPS} reached"
        part = stored.with_suffix(".part")      # (whole or absent: a worker killed mid-write)
        part.write_bytes(pickle.dumps(run))
        os.replace(part, stored)
        return run
