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
