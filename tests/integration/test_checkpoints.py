"""The checkpoint history without a server (``tabcohort_server.checkpoint.CheckpointStore``): the
newest K plus the best by accuracy, pruned on disk, reloaded by a restarted server, newest first
for a reader of the shared directory (``load_latest``)."""

from __future__ import annotations

import hashlib
import os
import struct

import pytest

from tabcohort_server import checkpoint as ck


def blob(x: float, n: int = 8) -> bytes:
    return struct.pack(f"<{n}f", *([x] * n))


def meta(step: int, data: bytes, acc: float | None) -> dict:
    return {"step": step, "digest": hashlib.sha256(data).hexdigest(), "n": 8, "accuracy": acc, "final": False}


def test_the_history_keeps_the_newest_k_and_the_best_and_a_restart_finds_them(tmp_path):
    d = str(tmp_path)
    st = ck.CheckpointStore(d, "r", keep=3)
    accs = [0.5, 0.9, 0.6, 0.7, 0.65, 0.66]          # the best (0.9, step 20) falls out of the newest 3
    for i, a in enumerate(accs):
        data = blob(i + 1.0)
        st.add(meta(10 * (i + 1), data, a), data)
    listed = st.list()
    assert [m["step"] for m in listed] == [60, 50, 40, 20]
    assert [m["best"] for m in listed] == [False, False, False, True]
    assert len(os.listdir(ck.history_dir(d, "r"))) == 4           # the others deleted
    got = st.get(listed[-1]["id"])
    assert got is not None and got[1] == blob(2.0)                  # read back from disk
    assert ck.load_latest(d, "r")[0]["step"] == 60 == ck.load(d, "r")[0]["step"]
    again = ck.CheckpointStore(d, "r", keep=3)                       # a restarted server
    assert [m["id"] for m in again.list()] == [m["id"] for m in listed]
    assert again.latest()[1] == blob(6.0)
    m = again.mark_final(again.latest_meta()["id"])
    assert m["final"] and ck.CheckpointStore(d, "r", keep=3).latest_meta()["final"]


def test_files_of_another_job_or_corrupt_are_left_alone(tmp_path):
    d = str(tmp_path)
    good = blob(1.0)
    ck.save(d, "r", meta(5, good, 0.8), good)
    other = blob(2.0, n=4)
    ck.save(d, "r", {**meta(9, other, 0.9), "n": 4}, other)          # another model: newest on disk
    with open(os.path.join(ck.history_dir(d, "r"), "step-00000000000000000099-000000000000.ckpt"), "wb") as f:
        f.write(b"garbage")
    st = ck.CheckpointStore(d, "r", accept=lambda m, data: m.get("n") == 8)
    assert [m["step"] for m in st.list()] == [5]
    # both told apart for serve's start-up lines (a damaged file was passed over in silence)
    assert st.n_refused == 1 and st.unreadable == ["step-00000000000000000099-000000000000.ckpt"]
    assert ck.load_latest(d, "r", accept=lambda m, data: m.get("n") == 8)[0]["step"] == 5
    assert ck.load_latest(d, "r")[0]["step"] == 9
    assert not ck.ID_RE.match("../x") and ck.ID_RE.match(st.latest_meta()["id"])


def test_in_memory_without_a_directory():
    st = ck.CheckpointStore(None, "r", keep=1)
    for i in range(3):
        data = blob(float(i))
        st.add(meta(i, data, 0.1 * i), data)
    assert [m["step"] for m in st.list()] == [2] and st.get(st.latest_meta()["id"])[1] == blob(2.0)


def test_a_second_server_on_the_same_checkpoint_directory_is_refused_before_it_listens(tmp_path):
    # two servers that are not one cluster each overwrote the other's ROOM.ckpt
    import subprocess
    import sys

    from tabcohort.errors import ConfigError
    from tabcohort_server.serve import lock_checkpoint_dir

    held = lock_checkpoint_dir(str(tmp_path))
    try:
        with pytest.raises(ConfigError) as e:
            lock_checkpoint_dir(str(tmp_path))
        assert e.value.variable == "--checkpoint-dir" and "another tabcohort serve" in str(e.value)
        r = subprocess.run([sys.executable, "-m", "tabcohort", "serve", "--port", "0", "--checkpoint-dir",
                            str(tmp_path)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "--checkpoint-dir" in r.stderr and "another tabcohort serve" in r.stderr, r
        assert "URL " not in r.stdout
    finally:
        held.close()
    lock_checkpoint_dir(str(tmp_path)).close()          # released with its holder


def test_a_file_system_without_locks_is_said_so_not_blamed_on_another_server(tmp_path, monkeypatch):
    import errno
    import fcntl

    from tabcohort.errors import ConfigError
    from tabcohort_server.serve import lock_checkpoint_dir

    def no_locks(*_a):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(ConfigError) as e:
        lock_checkpoint_dir(str(tmp_path))
    assert "cannot lock" in str(e.value) and "another tabcohort serve" not in str(e.value)


def test_another_jobs_newest_checkpoint_is_kept_in_the_history_before_it_is_replaced(tmp_path):
    # serve said another job's checkpoints were "left as they are", then this job's first
    # checkpoint replaced ROOM.ckpt, the other job's newest (here its only copy)
    d = str(tmp_path)
    other = blob(2.0, n=4)
    ck.save(d, "r", {**meta(90000, other, 0.9), "n": 4}, other)
    os.unlink(os.path.join(ck.history_dir(d, "r"), os.listdir(ck.history_dir(d, "r"))[0]))   # ROOM.ckpt alone
    before = open(ck.path_for(d, "r"), "rb").read()
    st = ck.CheckpointStore(d, "r", accept=lambda m, data: m.get("n") == 8)
    assert st.latest() is None and st.n_refused == 1 and st.refused_step == 90000
    assert st.refused_kept is not None and os.path.dirname(st.refused_kept) == ck.history_dir(d, "r")
    mine = blob(1.0)
    st.add(meta(5, mine, 0.5), mine)                                     # this job's first checkpoint
    assert ck.load_latest(d, "r", accept=lambda m, data: m.get("n") == 8)[0]["step"] == 5
    assert open(st.refused_kept, "rb").read() == before                  # the other job's, unchanged
    back = ck.load_latest(d, "r", accept=lambda m, data: m.get("n") == 4)   # the other job served again
    assert back is not None and back[0]["step"] == 90000 and back[1] == other
    again = ck.CheckpointStore(d, "r", accept=lambda m, data: m.get("n") == 8)   # a restart: nothing more copied
    assert again.refused_kept == st.refused_kept and len(os.listdir(ck.history_dir(d, "r"))) == 2


def test_serve_says_where_another_jobs_checkpoints_are_kept_and_keeps_them(tmp_path):
    # the trial: a finished default job's directory, served with --hidden 64 and one rank
    from .conftest import Cluster, wait_for

    first = Cluster(tmp_path / "a")
    (tmp_path / "a").mkdir()
    ckdir = tmp_path / "ckpt"
    try:
        first.serve("--dataset", "synthetic", "--steps", "20", "--checkpoint-dir", str(ckdir))
        r = first.rank()
        assert r.p.wait(90) == 0, r.text()[-3000:]
        wait_for(lambda: (g := ck.load(str(ckdir), "digits")) and g[0].get("final"), 20, "the final checkpoint")
    finally:
        first.close()
    for p in (ckdir / "digits.history").iterdir():     # the other job's newest only as digits.ckpt
        p.unlink()
    old = (ckdir / "digits.ckpt").read_bytes()
    second = Cluster(tmp_path / "b")
    (tmp_path / "b").mkdir()
    try:
        second.serve("--dataset", "synthetic", "--hidden", "64", "--checkpoint-dir", str(ckdir))
        said = second.server.text()
        assert "starts from scratch" in said and "are of another job" in said and "left as they are" not in said, said
        assert f"kept in {ckdir / 'digits.history'} (the newest: step-00000000000000000020-" in said, said
        second.rank()
        wait_for(lambda: (ckdir / "digits.ckpt").read_bytes() != old, 60, "this job's first checkpoint in digits.ckpt")
    finally:
        second.close()
    kept = [p for p in (ckdir / "digits.history").iterdir() if p.name.startswith("step-00000000000000000020-")]
    assert len(kept) == 1 and kept[0].read_bytes() == old
