"""Module jobs end to end (README "Write your own job", "Trust model"): ``serve --job`` refuses
a bad job before listening (exit 2, saying what is wrong), a native rank runs a served job only
with ``--trust-job`` or a matching local ``--job``, the example jobs train to their stated
held-out metrics with the ranks bit-identical, and the model export evaluates."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import time
import urllib.request
import zipfile

import pytest

from .conftest import ROOT, _env, wait_for

pytestmark = pytest.mark.integration

CNN = str(ROOT / "examples" / "jobs" / "cnn_digits.py")
CHAR = str(ROOT / "examples" / "jobs" / "char_model.py")

#: a correct job the bad cases below break one thing of (linear softmax on 4 features)
GOOD = '''\
import math
from array import array

SPEC = {"name": "tiny"}
N = 4 * 2 + 2


def load_data():
    import numpy as np
    x = np.array([[i % 2, (i // 2) % 2, 1, 0] for i in range(16)], dtype=np.float32)
    return {"x": x, "y": (x[:, 0]).astype(np.int32)}


class Tiny:
    backend = "python"

    def __init__(self, data, batch):
        self.x, self.y, self.batch, self.bucket_len = data["x"], data["y"], batch, BUCKET_LEN
        self.p = array("f", [0.0] * N)

    def params(self):
        return array("f", self.p)

    def set_params(self, v):
        self.p = array("f", v)

    def grads(self, offset, samples):
        return LOSS, array("f", [0.0] * GRAD_LEN)

    def evaluate(self):
        return 0.5


BUCKET_LEN, GRAD_LEN, LOSS = N, N, 0.7


def make_worker(data, *, batch, seed, backend):
    return Tiny(data, batch)
'''


def _serve_job(tmp_path: pathlib.Path, src: str, *extra: str) -> subprocess.CompletedProcess:
    job = tmp_path / "badjob.py"
    job.write_text(src)
    return subprocess.run([sys.executable, "-m", "tabcohort.cli", "serve", "--port", "0", "--job", str(job), *extra],
                          capture_output=True, text=True, timeout=120, env=_env(), cwd=str(ROOT))


def test_good_tiny_job_is_accepted(tmp_path):
    """The base of the bad cases is a job serve accepts (so each case fails for its one defect)."""
    from tabcohort.jobs import load_job, probe
    job = tmp_path / "tiny.py"
    job.write_text(GOOD)
    w = probe(load_job(str(job)), batch=8, seed=0)
    assert w.bucket_len == 10
    # the state report's epoch: the worker's train_len, else the rows of y_train / x_train
    assert w.train_len is None                    # (data "x", "y" and no train_len: no epoch)
    job.write_text(GOOD.replace('        self.p = array("f", [0.0] * N)',
                                '        self.p = array("f", [0.0] * N)\n        self.train_len = 16'))
    assert load_job(str(job)).make_worker(batch=8, seed=0, backend="python").train_len == 16
    cnn = load_job(CNN)
    assert cnn.make_worker(batch=8, seed=0, backend="python").train_len == len(cnn.data["y_train"]) > 0


@pytest.mark.parametrize("case,src,expect", [
    ("syntax", GOOD.replace("class Tiny:", "class Tiny(:"), r"syntax error in .*badjob\.py:\d+"),
    ("factory", GOOD.replace("    return Tiny(data, batch)", "    raise RuntimeError('no GPU here')"),
     r"factory make_worker\(\) raised RuntimeError: no GPU here \(.*badjob\.py:\d+\)"),
    ("bucket_len", GOOD.replace("BUCKET_LEN, GRAD_LEN, LOSS = N, N,", "BUCKET_LEN, GRAD_LEN, LOSS = N + 3, N,"),
     r"bucket_len 13 disagrees with params\(\), which has 10 values"),
    ("grad_length", GOOD.replace("BUCKET_LEN, GRAD_LEN, LOSS = N, N,", "BUCKET_LEN, GRAD_LEN, LOSS = N, N - 1,"),
     r"grads\(\) returned 9 gradient values, but the worker's bucket_len is 10"),
    ("non_finite", GOOD.replace("LOSS = N, N, 0.7", "LOSS = N, N, float('nan')"),
     r"grads\(0\) on a probe batch is not finite"),
    ("data_hash", GOOD.replace('SPEC = {"name": "tiny"}', 'SPEC = {"name": "tiny"}\nDATA_SHA256 = "00" * 32'),
     r"data hash mismatch: load_data\(\) gave sha256 [0-9a-f]{64}, the job declares DATA_SHA256"),
    ("python_path_only", GOOD.replace("    return Tiny(data, batch)",
                                      "    w = Tiny(data, batch)\n    w.bucket_len += backend == 'python'\n    return w"),
     r"bucket_len 11 disagrees with params\(\), which has 10 values"),
    ("import_raises", GOOD.replace("N = 4 * 2 + 2", "N = 4 * 2 + 2\nimport no_such_module_here"),
     r"importing the job raised ModuleNotFoundError.*badjob\.py:\d+"),
    ("evaluate_range", GOOD.replace("        return 0.5", "        return 7.0"),
     r"evaluate\(\) must return held-out accuracy in \[0, 1\], got 7\.0"),
    ("grads_not_a_pair", GOOD.replace('        return LOSS, array("f", [0.0] * GRAD_LEN)',
                                      "        return LOSS, array('f', [0.0] * GRAD_LEN), 3"),
     r"grads\(\) must return a pair \(loss, gradient\), got tuple \(0\.7, array"),
    ("grads_loss_a_string", GOOD.replace("LOSS = N, N, 0.7", "LOSS = N, N, '0.7'"),
     r"grads\(\) must return a number as its loss, got str '0\.7'"),
    ("missing_method", GOOD.replace("    def grads(self, offset, samples):", "    def grads_renamed(self, offset, samples):"),
     r"the worker make_worker\(\) returned has no 'grads'"),
    ("grads_a_number", GOOD.replace('        return LOSS, array("f", [0.0] * GRAD_LEN)', "        return LOSS, 0.0"),
     r"grads\(\) must return a vector as its gradient, got float"),
    # (a new-user trial: "grads(0) raised ValueError: could not convert string to float" at a line
    # of tabcohort's own; python and numpy workers)
    ("grads_a_string", GOOD.replace('        return LOSS, array("f", [0.0] * GRAD_LEN)', "        return LOSS, 'hello'"),
     r"grads\(\) returned a gradient that is not a sequence of numbers: got str 'hello' "
     r"\(.*badjob\.py:\d+, where grads is defined\)"),
    ("grads_strings_numpy", GOOD.replace('        return LOSS, array("f", [0.0] * GRAD_LEN)',
                                         "        return LOSS, ['x'] * GRAD_LEN").replace(
        '    backend = "python"', '    backend = "numpy"'),
     r"grads\(\) returned a gradient that is not a sequence of numbers \(could not convert .*\): got list "
     r".*badjob\.py:\d+, where grads is defined"),
    # (a new-user trial: an integer gradient, all zeros, passed every check and never trained;
    # a (1, N) one was said to have 1 value)
    ("grads_integer_numpy", GOOD.replace('        return LOSS, array("f", [0.0] * GRAD_LEN)',
                                         "        return LOSS, __import__('numpy').zeros(GRAD_LEN, dtype='int32')"),
     r"grads\(\) returned a gradient of dtype int32: it must be floating point \(float32\) \(.*badjob\.py:\d+"),
    ("grads_integer_array", GOOD.replace('        return LOSS, array("f", [0.0] * GRAD_LEN)',
                                         "        return LOSS, array('i', [0] * GRAD_LEN)"),
     r"grads\(\) returned a gradient of typecode 'i': it must be floating point"),
    ("grads_2d", GOOD.replace('        return LOSS, array("f", [0.0] * GRAD_LEN)',
                              "        return LOSS, __import__('numpy').zeros((1, GRAD_LEN), dtype='float32')"),
     r"grads\(\) returned a gradient of shape \(1, 10\): it must be one flat vector of bucket_len = 10 values"),
    # (it pointed at the line of tabcohort's own that called the factory)
    ("options_without_keyword", GOOD.replace('SPEC = {"name": "tiny"}', 'SPEC = {"name": "tiny"}\nOPTIONS = {"k": 1}')
                                    .replace("def load_data():", "def load_data(options):"),
     r"unexpected keyword argument 'options' \(.*badjob\.py:\d+ \(where make_worker is defined\)\)"),
    # (each pointed at a line of tabcohort's own, or named a "function" that is not one: a new-user trial)
    ("loss_an_array", GOOD.replace("LOSS = N, N, 0.7", "LOSS = N, N, __import__('numpy').array([0.7, 0.7])"),
     r"grads\(\) must return a number as its loss \(the batch's mean\), got ndarray"),
    ("evaluate_none", GOOD.replace("        return 0.5", "        return None"),
     r"evaluate\(\) must return a number \(held-out accuracy in \[0, 1\]\), got NoneType None"),
    ("set_params_noop", GOOD.replace("        self.p = array(\"f\", v)", "        pass"),
     r"set_params\(v\) does not set the parameters"),

    # (a class as the factory pointed at tabcohort's own line that called it: a new-user trial)
    ("class_as_factory", GOOD.replace("def make_worker(data, *, batch, seed, backend):\n    return Tiny(data, batch)",
                                      "make_worker = Tiny"),
     r"make_worker\(\) raised TypeError: .*unexpected keyword argument '(seed|backend)' "
     r"\(.*badjob\.py:\d+ \(where Tiny is defined\)\)"),
    # (a new-user trial: a job with no load_data() was told only "make_worker() raised KeyError: 'x'")
    ("no_load_data", GOOD.replace("def load_data():", "def _not_load_data():"),
     r"make_worker\(\) raised KeyError: 'x' \(.*badjob\.py:\d+\); the job has no data: its factory's data is an "
     r"empty dict \(its module defines no load_data\(\)"),
    # (a new-user trial: a pure-Python path with the gradient's sign flipped was served, and a
    # tab on it pushed the model the other way; simulate on it said "done")
    ("paths_disagree", GOOD.replace('        return LOSS, array("f", [0.0] * GRAD_LEN)',
                                    '        return LOSS, array("f", [self.sign] * GRAD_LEN)')
                           .replace("    return Tiny(data, batch)",
                                    "    w = Tiny(data, batch)\n    w.sign = -1.0 if backend == 'python' else 1.0\n"
                                    "    return w"),
     r"its numpy and pure-Python paths disagree on the same \d+ samples and parameters \(loss 0.7 and 0.7; the "
     r"gradients differ by 2 of the larger one's norm"),
])
def test_serve_refuses_a_bad_job(tmp_path, case, src, expect):
    r = _serve_job(tmp_path, src)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "configuration error: --job=" in r.stderr, r.stderr
    assert re.search(expect, r.stderr), r.stderr
    assert "URL " not in r.stdout      # it never listened


def _serve_example(cluster, job: str, *extra: str) -> None:
    cluster.serve("--job", job, *extra)


def test_native_rank_refuses_a_served_job_without_trust(cluster, tmp_path):
    _serve_example(cluster, CNN)
    p = cluster.rank()
    assert p.p.wait(60) == 2, p.text()
    out = p.text()
    assert "--trust-job" in out and "TABCOHORT_TRUST_JOB=1" in out and "--job PATH" in out, out
    assert "joined" not in out
    # a local copy that differs (one comment) is refused too, naming both hashes' owner
    copy = tmp_path / "cnn_digits.py"
    copy.write_text(pathlib.Path(CNN).read_text() + "\n# my edit\n")
    q = cluster.rank("--job", str(copy))
    assert q.p.wait(60) == 2, q.text()
    assert "is not the room's job 'cnn-digits-3x3x6'" in q.text() and "joined" not in q.text(), q.text()
    assert cluster.state()["ranks"] == []


def _train(cluster, job: str, *, steps: int, lr: str, rank_args: list[list[str]],
           serve_extra: tuple[str, ...] = ()) -> tuple[dict, list]:
    _serve_example(cluster, job, "--steps", str(steps), "--lr", lr, "--checkpoint-interval", "1", *serve_extra)
    ranks = [cluster.rank(*a) for a in rank_args]
    for p in ranks:
        assert p.p.wait(240) == 0, p.text()
    digests = [re.findall(r"digest ([0-9a-f]{16})", p.text())[-1] for p in ranks]
    ck = wait_for(lambda: (c := cluster.state()["checkpoint"]) and c["final"] and c, 20, "the final checkpoint")
    lead = [r for r in cluster.reports(connected_only=False) if r.get("speeds")]
    print(f"\n{pathlib.Path(job).name}: the leader's measured samples/s by rank: {lead[-1]['speeds'] if lead else '?'}")
    return ck, digests


def _fetch(cluster, path: str) -> bytes:
    req = urllib.request.Request(f"{cluster.url}/api/rooms/{cluster.room}{path}", headers=cluster._auth())
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read()


def test_cnn_job_trains_bit_identical_and_exports(cluster, tmp_path):
    """Two native ranks (numpy with --trust-job; the pure-Python path from a local copy) train the
    CNN job to >= 90 % held-out accuracy in 200 steps; the export evaluates to the same."""
    ck, digests = _train(cluster, CNN, steps=200, lr="0.3",
                         rank_args=[["--trust-job"], ["--job", CNN, "--backend", "python"]])
    assert len(set(digests)) == 1 and ck["digest"].startswith(digests[0]), (digests, ck)
    assert ck["step"] == 200 and ck["accuracy"] >= 0.90, ck
    model = tmp_path / "model.npz"
    model.write_bytes(_fetch(cluster, "/model"))
    import numpy as np
    with np.load(model) as z:
        assert z["params"].dtype == np.float32 and z["params"].shape == (2230,)
        meta = json.loads(bytes(z["job.json"]))
    assert meta["job_info"]["name"] == "cnn-digits-3x3x6" and meta["checkpoint"]["step"] == 200
    # (a new-user trial: a module job's export named the built-in MLP's dataset and layers)
    assert not {"dataset", "hidden", "activation"} & set(meta), sorted(meta)
    r = subprocess.run([sys.executable, "-m", "tabcohort.cli", "evaluate", "--job", CNN, "--model", str(model),
                        "--json"], capture_output=True, text=True, timeout=120, env=_env(), cwd=str(ROOT))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["step"] == 200 and abs(res["accuracy"] - ck["accuracy"]) < 1e-9 and res["loss"] < 0.5, res
    print(f"cnn job: step 200, held-out accuracy {ck['accuracy']:.4f}, loss {res['loss']:.4f}, "
          f"2 ranks bit-identical ({digests[0]})")


def test_char_job_trains_bit_identical(cluster):
    """The sequence job: two native ranks reach >= 70 % held-out next-character accuracy in 300 steps."""
    ck, digests = _train(cluster, CHAR, steps=300, lr="0.5",
                         rank_args=[["--trust-job"], ["--trust-job", "--backend", "python"]])
    assert len(set(digests)) == 1 and ck["digest"].startswith(digests[0]), (digests, ck)
    assert ck["step"] == 300 and ck["accuracy"] >= 0.70, ck
    print(f"char job: step 300, held-out accuracy {ck['accuracy']:.4f}, 2 ranks bit-identical ({digests[0]})")


def test_autograd_job_trains_natively(cluster):
    """A job whose gradients autograd derives from plain numpy code (numpy only: the server
    says so with backends ["numpy"]); two native ranks reach >= 93 % held-out accuracy."""
    ck, digests = _train(cluster, str(ROOT / "examples" / "jobs" / "autograd_mlp.py"), steps=200, lr="0.5",
                         rank_args=[["--trust-job"], ["--trust-job"]])
    assert len(set(digests)) == 1 and ck["digest"].startswith(digests[0]), (digests, ck)
    assert ck["step"] == 200 and ck["accuracy"] >= 0.93, ck
    job = json.loads(_fetch(cluster, "/job"))
    assert job["job_info"]["backends"] == ["numpy"], job["job_info"]


def test_a_job_whose_backends_leave_python_out_is_served_and_trains(cluster, tmp_path):
    """README "Write your own job": ``BACKENDS = ("numpy",)`` declares a numpy-only job; serve
    refused it (a ConfigError naming a --backend nobody gave: the server asked its factory for
    the python path anyway, as a new user found)."""
    job = tmp_path / "numpy_only.py"
    job.write_text(GOOD.replace('SPEC = {"name": "tiny"}', 'SPEC = {"name": "tiny"}\nBACKENDS = ("numpy",)'))
    ck, digests = _train(cluster, str(job), steps=30, lr="0.1", rank_args=[["--trust-job"]])
    assert ck["step"] == 30 and ck["digest"].startswith(digests[0]), (digests, ck)
    info = json.loads(_fetch(cluster, "/job"))["job_info"]
    assert info["backends"] == ["numpy"] and info["accepts"] == ["numpy"], info


def test_the_readme_job_trains(cluster, tmp_path):
    """README "Write your own job": its complete job (under 40 lines), copied as a user would,
    is accepted by serve and trained by two native ranks to >= 85 % held-out accuracy."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Write your own job"):]
    code = section[section.index("```python\n") + len("```python\n"):]
    code = code[:code.index("```")]
    assert code.startswith('"""my_job.py') and len(code.splitlines()) < 40, len(code.splitlines())
    job = tmp_path / "my_job.py"
    job.write_text(code)
    ck, digests = _train(cluster, str(job), steps=150, lr="0.5", rank_args=[["--trust-job"], ["--job", str(job)]])
    assert len(set(digests)) == 1 and ck["digest"].startswith(digests[0]), (digests, ck)
    assert ck["step"] == 150 and ck["accuracy"] >= 0.85, ck
    print(f"README job: {len(code.splitlines())} lines, step 150, held-out accuracy {ck['accuracy']:.4f}")
    # its export evaluates; it has no evaluate_loss(): the loss is null in JSON (NaN is not JSON)
    model = tmp_path / "my_job.npz"
    model.write_bytes(_fetch(cluster, "/model"))
    r = subprocess.run([sys.executable, "-m", "tabcohort.cli", "evaluate", "--job", str(job), "--model", str(model),
                        "--json"], capture_output=True, text=True, timeout=120, env=_env(), cwd=str(ROOT))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"not JSON: {c} in {r.stdout}"))
    assert res["loss"] is None and abs(res["accuracy"] - ck["accuracy"]) < 1e-9, res


@pytest.mark.parametrize("train", [[], ["--local-steps", "2"]], ids=["sgd", "local-steps"])
def test_the_builtin_job_exports_and_evaluates(cluster, tmp_path, train):
    """The built-in MLP job is exported the same way and evaluates without --job (the install's
    own copy of it, its code hash the model's), whatever its training settings (they are part
    of its job hash)."""
    cluster.serve("--steps", "60", "--checkpoint-interval", "1", *train)
    p = cluster.rank()
    assert p.p.wait(120) == 0, p.text()
    ck = wait_for(lambda: (c := cluster.state()["checkpoint"]) and c["final"] and c, 20, "the final checkpoint")
    # a finished room keeps its last leader's figures (a new user saw accuracy, loss: null)
    st = cluster.state()
    assert st["leader"] is None and st["accuracy"] is not None and st["loss"] is not None, st
    model = tmp_path / "mlp.npz"
    model.write_bytes(_fetch(cluster, "/model"))
    r = subprocess.run([sys.executable, "-m", "tabcohort.cli", "evaluate", "--model", str(model), "--json"],
                       capture_output=True, text=True, timeout=120, env=_env(), cwd=str(ROOT))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["step"] == 60 and abs(res["accuracy"] - ck["accuracy"]) < 1e-9, (res, ck)
    # a model file that cannot be read is a configuration error naming it
    bad = subprocess.run([sys.executable, "-m", "tabcohort.cli", "evaluate", "--model", str(tmp_path / "none.npz")],
                         capture_output=True, text=True, timeout=60, env=_env(), cwd=str(ROOT))
    assert bad.returncode == 2 and "--model=" in bad.stderr and "cannot read it" in bad.stderr, bad.stderr
    # a raw checkpoint (float32 parameters, no job) is refused, saying where the export is
    if not train:
        raw = tmp_path / "raw.bin"
        raw.write_bytes(b"\0" * 64)
        bad = subprocess.run([sys.executable, "-m", "tabcohort.cli", "evaluate", "--model", str(raw)],
                             capture_output=True, text=True, timeout=60, env=_env(), cwd=str(ROOT))
        assert bad.returncode == 2 and "/api/rooms/ROOM/model" in bad.stderr, bad.stderr
    # an export whose job hash is not the built-in job's here is refused, naming the file
    forged = tmp_path / "forged.npz"
    with zipfile.ZipFile(model) as zin, zipfile.ZipFile(forged, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename == "job.json":
                job = json.loads(data)
                job["job_hash"] = "0" * 64
                data = json.dumps(job).encode()
            zout.writestr(info, data)
    bad = subprocess.run([sys.executable, "-m", "tabcohort.cli", "evaluate", "--model", str(forged)],
                         capture_output=True, text=True, timeout=60, env=_env(), cwd=str(ROOT))
    assert bad.returncode == 2 and "--job=" in bad.stderr and "is not the model's" in bad.stderr, bad.stderr
    # a non-finite parameter is refused, naming it (it printed "held-out accuracy 7.22 %", exit 0)
    import io

    import numpy as np
    nan = tmp_path / "nan.npz"
    with zipfile.ZipFile(model) as zin, zipfile.ZipFile(nan, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename == "params.npy":
                arr = np.load(io.BytesIO(data))
                arr[7] = np.nan
                buf = io.BytesIO()
                np.save(buf, arr)
                data = buf.getvalue()
            zout.writestr(info, data)
    bad = subprocess.run([sys.executable, "-m", "tabcohort.cli", "evaluate", "--model", str(nan)],
                         capture_output=True, text=True, timeout=60, env=_env(), cwd=str(ROOT))
    assert bad.returncode == 2 and "--model=" in bad.stderr and "1 of its" in bad.stderr \
        and "not finite (the first at index 7: nan)" in bad.stderr, bad.stderr


def test_simulate_trains_a_job_in_process(tmp_path):
    """``tabcohort simulate --job``: a job tried without a server (three ranks, one process)."""
    r = subprocess.run([sys.executable, "-m", "tabcohort.cli", "simulate", "--job", CNN, "--ranks", "3",
                        "--steps", "150", "--lr", "0.3", "--json"],
                       capture_output=True, text=True, timeout=300, env=_env(), cwd=str(ROOT))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["bit_identical"] and res["steps"] == 150 and res["accuracy"] >= 0.90, res
    bad = tmp_path / "bad.py"
    bad.write_text(GOOD.replace("class Tiny:", "class Tiny(:"))
    r = subprocess.run([sys.executable, "-m", "tabcohort.cli", "simulate", "--job", str(bad)],
                       capture_output=True, text=True, timeout=120, env=_env(), cwd=str(ROOT))
    assert r.returncode == 2 and "syntax error in" in r.stderr, r.stderr


def test_a_local_job_for_a_room_of_the_builtin_job_is_refused(cluster):
    cluster.serve()
    p = cluster.rank("--job", CNN)
    assert p.p.wait(60) == 2, p.text()
    assert "is not the room's job 'mlp'" in p.text() and "joined" not in p.text(), p.text()


def test_a_module_job_trains_with_local_steps_bit_identical(cluster):
    """docs/PROTOCOL.md "Local steps and optimizer state" with a module job: the CNN job with 4
    inner steps per round and the leader's Nesterov outer step; two native ranks (numpy and the
    pure-Python path), both in the cohort, end bit-identical at the stop, and the checkpoint
    carries the momentum after the parameters."""
    _serve_example(cluster, CNN, "--lr", "0.7", "--local-steps", "4", "--inner-lr", "0.3",
                   "--checkpoint-interval", "1")
    ranks = [cluster.rank("--trust-job"), cluster.rank("--trust-job", "--backend", "python")]

    def trained():
        reps = [r for r in cluster.reports() if r.get("ready")]
        s = cluster.state()
        return (len(reps) == 2 and all(r["cohort"] == 2 for r in reps) and s["step"] >= 40
                and s["accuracy"] is not None and s["accuracy"] >= 0.80 and s)
    st = wait_for(trained, 180, "two ready ranks in one cohort past step 40 at >= 80 % held-out accuracy")
    cluster.post(f"/api/rooms/{cluster.room}/stop")
    for p in ranks:
        assert p.p.wait(60) == 0, p.text()
    digests = [re.findall(r"digest ([0-9a-f]{16})", p.text())[-1] for p in ranks]
    assert len(set(digests)) == 1, (digests, ranks[1].text()[-2000:])
    job = json.loads(_fetch(cluster, "/job"))
    assert job["local_steps"] == 4 and job["outer_optimizer"] == "nesterov" and job["state_len"] == job["bucket_len"]
    assert len(_fetch(cluster, "/checkpoint")) == 8 * job["bucket_len"]
    print(f"cnn job, 4 local steps: step {st['step']}, held-out accuracy {st['accuracy']:.4f}, "
          f"2 ranks (numpy, pure Python) bit-identical ({digests[0]})")


def test_job_options_from_the_command_line_reach_the_job(tmp_path):
    """``--job-option NAME=VALUE`` (VALUE as JSON) overrides a job's ``OPTIONS`` in simulate and
    serve; an option the job does not have is refused naming the ones it has, before anything
    listens; the built-in job's own options are refused with --job."""
    job = tmp_path / "optjob.py"
    job.write_text(GOOD.replace('SPEC = {"name": "tiny"}', 'SPEC = {"name": "tiny"}\nOPTIONS = {"acc": 0.5}')
                   .replace("def load_data():", "def load_data(options):")
                   .replace("def make_worker(data, *, batch, seed, backend):\n    return Tiny(data, batch)",
                            "def make_worker(data, *, batch, seed, backend, options):\n    w = Tiny(data, batch)\n"
                            "    w.evaluate = lambda: options['acc']\n    return w"))
    sim = [sys.executable, "-m", "tabcohort.cli", "simulate", "--job", str(job), "--ranks", "2", "--steps", "20",
           "--json"]
    r = subprocess.run(sim + ["--job-option", "acc=0.25"], capture_output=True, text=True, timeout=120,
                       env=_env(), cwd=str(ROOT))
    assert r.returncode == 0 and json.loads(r.stdout)["accuracy"] == 0.25, r.stderr
    assert f"job {job} (acc=0.25), global batch" in r.stderr, r.stderr   # (the banner says what ran)
    r = subprocess.run(sim + ["--job-option", "acc=1e999"], capture_output=True, text=True, timeout=120,
                       env=_env(), cwd=str(ROOT))
    assert r.returncode == 2 and "--job-option='acc=1e999': 1e999 is not a finite number" in r.stderr, r.stderr
    r = _serve_job(tmp_path, job.read_text(), "--job-option", "size=3")
    assert r.returncode == 2 and "no such option size (the job's options: acc)" in r.stderr, r.stderr
    r = _serve_job(tmp_path, job.read_text(), "--activation", "tanh")
    assert r.returncode == 2 and "--activation='tanh'" in r.stderr and "--job-option" in r.stderr, r.stderr


def test_serve_refuses_a_built_in_model_too_large_for_a_checkpoint_at_once():
    r = subprocess.run([sys.executable, "-m", "tabcohort.cli", "serve", "--port", "0", "--hidden", "100000000"],
                       capture_output=True, text=True, timeout=60, env=_env(), cwd=str(ROOT))
    assert r.returncode == 2 and "--hidden='100000000'" in r.stderr and "at most 67,108,864" in r.stderr, r.stderr


def _serve_says(args: list[str], until: str) -> str:
    """What ``serve ARGS`` prints up to the first line containing ``until`` (bounded: 60 s);
    the server is then stopped."""
    import time

    p = subprocess.Popen([sys.executable, "-m", "tabcohort.cli", "serve", "--port", "0", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=str(ROOT))
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(until in x for x in lines):
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
        return "".join(lines)
    finally:
        p.kill()
        p.wait(10)


def test_serve_says_why_it_does_not_resume_from_another_jobs_checkpoints(tmp_path):
    """A checkpoint directory whose checkpoints are of another job (here: another --hidden) is
    left alone, and serve says the room starts from scratch and why."""
    import hashlib

    from tabcohort_server import checkpoint as ckpt
    data = b"\0" * 4 * 10
    ckpt.save(str(tmp_path), "digits", {"step": 1234, "digest": hashlib.sha256(data).hexdigest(), "n": 10,
                                        "job_hash": "0" * 32}, data)
    said = _serve_says(["--dataset", "synthetic", "--checkpoint-dir", str(tmp_path)], "starts from scratch")
    assert "room digits starts from scratch: the 1 checkpoint(s)" in said, said
    assert "(newest at step 1234) are of another job" in said, said


def test_serve_names_a_module_job_s_room_after_the_module(tmp_path):
    """Without --room a module job's room is named after its module (its checkpoints are
    ``cnn_digits.ckpt``, not the built-in room's ``digits.ckpt``), and the join line says so."""
    from tabcohort.cli import default_room_name
    assert default_room_name(None) == "digits"
    assert default_room_name("jobs/my_job.py:make") == "my_job" and default_room_name("pkg.mod:make") == "mod"
    assert default_room_name("/x/ünï côde.py") == "n--c-de" and default_room_name("...py") == "job"
    assert default_room_name("/x/pkg/__init__.py") == "pkg" and default_room_name("-x.py") == "x"
    # a directory of a run from before (its room was "digits"): said, not silently passed by
    import hashlib

    from tabcohort_server import checkpoint as ckpt
    data = b"\0" * 4 * 10
    ckpt.save(str(tmp_path), "digits", {"step": 77, "digest": hashlib.sha256(data).hexdigest(), "n": 10,
                                        "job_hash": "0" * 32}, data)
    said = _serve_says(["--job", CNN, "--checkpoint-dir", str(tmp_path)], "URL ")
    assert " room cnn_digits (job cnn-digits-3x3x6" in said, said
    assert "--room cnn_digits --trainer-token" in said and "/?room=cnn_digits" in said, said
    assert f"room cnn_digits starts from scratch: {tmp_path} holds checkpoints of digits, not of cnn_digits; " \
           "--room digits resumes that room" in said, said
    # the start-up check is said before it runs (up to two minutes said nothing: a new-user trial)
    assert f"checking the job {CNN} of room cnn_digits (its import, load_data() within 600 s" in said, said
    assert "no --checkpoint-dir" not in said, said
    # a server that keeps nothing says so (a restart lost the training, unwarned)
    said = _serve_says(["--job", CNN], "URL ")
    assert "warning: no --checkpoint-dir: no checkpoint is kept; a restarted server starts its rooms from " \
           "scratch" in said, said


def _evaluate_failing_later() -> str:
    """GOOD, whose evaluate() raises from its 4th call on (a job bug the start-up check, which
    calls it once, does not meet)."""
    return GOOD.replace('    def evaluate(self):\n        return 0.5\n',
                        '    def evaluate(self):\n'
                        '        self.evals = getattr(self, "evals", 0) + 1\n'
                        '        if self.evals > 3:\n'
                        '            raise KeyError("eval oops")\n'
                        '        return 0.5\n')


def _failing_later(how: str) -> str:
    """GOOD, whose grads() goes bad after its 20th call: ``nan`` returns NaN gradients, ``raise``
    raises, ``short`` returns a gradient one value short (a job bug that a warm-up did not meet)."""
    bad = {"nan": '            return LOSS, array("f", [math.nan] * GRAD_LEN)',
           "raise": '            raise RuntimeError("boom in grads")',
           "short": '            return LOSS, array("f", [0.0] * (GRAD_LEN - 1))'}[how]
    return GOOD.replace('        return LOSS, array("f", [0.0] * GRAD_LEN)',
                        '        self.calls = getattr(self, "calls", 0) + 1\n'
                        '        if self.calls > 20:\n' + bad + '\n'
                        '        return LOSS, array("f", [0.0] * GRAD_LEN)')


def test_a_job_whose_gradients_turn_nan_stops_the_room_diverged(cluster, tmp_path):
    # README "Divergence": every bucket NaN (the leader's own dropped, counted in `diverged`):
    # the room stopped with nothing but a drop counter rising, and a lone rank spun at a core
    job = tmp_path / "nan_later.py"
    job.write_text(_failing_later("nan"))
    cluster.serve("--job", str(job))
    ranks = [cluster.rank("--trust-job") for _ in range(2)]
    st = wait_for(lambda: (s := cluster.state())["stopped"] and s, 60, "the room to stop")
    assert st["stop_reason"].startswith("diverged at step") and "not finite" in st["stop_reason"], st["stop_reason"]
    assert [p.p.wait(30) for p in ranks] == [1, 1], [p.text()[-1500:] for p in ranks]


def test_a_job_whose_grads_raise_every_time_ends_each_rank_with_the_job_s_line(cluster, tmp_path):
    # a job that raises on every call retried for good: the ranks printed a warning every 0.4 s
    # and never ended; now each rank stops after 3 failures in a row, naming the job's line
    job = tmp_path / "raise_later.py"
    job.write_text(_failing_later("raise"))
    cluster.serve("--job", str(job))
    ranks = [cluster.rank("--trust-job") for _ in range(2)]
    codes = [p.p.wait(60) for p in ranks]
    for p in ranks:
        out = p.text()
        assert "job failed: the job's compute failed 3 times in a row: RuntimeError: boom in grads" in out, out[-2000:]
        assert re.search(r"raise_later\.py:\d+ in grads", out), out[-2000:]
    assert codes == [1, 1]
    # ... and the operator sees why in each rank's last report (the operator view's Fault column)
    faults = [r.get("fault") or "" for r in cluster.reports(connected_only=False)]
    assert len(faults) == 2 and all(re.search(r"boom in grads \(at raise_later\.py:\d+ in grads\)", f)
                                    for f in faults), faults
    # ... and the server's console says it too (it said nothing where the server runs)
    assert re.search(r"room \S+: rank [0-9a-f]{8} reports a fault: .*boom in grads", cluster.server.text()), \
        cluster.server.text()[-2000:]


def _hanging_job(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A job whose grads() hangs from its 21st call on (after writing the returned marker file)."""
    marker = tmp_path / "hanging"
    job = tmp_path / "hangs_later.py"
    job.write_text(GOOD.replace('        return LOSS, array("f", [0.0] * GRAD_LEN)',
                                '        self.calls = getattr(self, "calls", 0) + 1\n'
                                '        if self.calls > 20:\n'
                                f'            import pathlib, time; pathlib.Path({str(marker)!r}).write_text("")\n'
                                '            time.sleep(600)\n'
                                '        return LOSS, array("f", [0.0] * GRAD_LEN)'))
    return job, marker


@pytest.mark.parametrize("again,code,said", [
    (True, 130, "1 rank still connected; stopping anyway (no final checkpoint of room digits)"),
    (False, 1, "1 rank still connected; stopping anyway after 10 s (no final checkpoint of room digits)")])
def test_an_ordered_stop_cut_short_says_so_in_serve_s_exit_code(cluster, tmp_path, again, code, said):
    # new-user trials and a reviewer: serve's ordered stop cut short by a rank that cannot leave
    # (its job hangs, so it cannot upload) exited 0, as if the final checkpoint were stored:
    # Ctrl-C again (130, as a rank's forced stop) or the 10 s bound passing (1)
    import os
    import signal
    job, marker = _hanging_job(tmp_path)
    cluster.serve("--job", str(job))
    rank = cluster.rank("--trust-job")
    try:
        wait_for(lambda: marker.exists(), 60, "the job's grads to hang")
        cluster.server.p.send_signal(signal.SIGINT)
        if again:
            wait_for(lambda: "waiting up to" in cluster.server.text(), 10, "the server's ordered stop")
            cluster.server.p.send_signal(signal.SIGINT)
        assert cluster.server.p.wait(30) == code, cluster.server.text()[-2000:]
        assert said in cluster.server.text(), cluster.server.text()[-2000:]
    finally:
        os.kill(rank.p.pid, signal.SIGKILL)


@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_second_signal_stops_a_rank_whose_job_hangs_in_grads(cluster, tmp_path, sig, code):
    # a new-user trial: a job whose grads() hung mid-run held the event loop, and with it the
    # ordered stop the first Ctrl-C (or SIGTERM) asks for: only SIGKILL ended the rank. The first
    # signal still asks for the ordered stop; a second one stops the rank at once
    import os
    import signal
    job, marker = _hanging_job(tmp_path)
    cluster.serve("--job", str(job))
    rank = cluster.rank("--trust-job")
    wait_for(lambda: marker.exists(), 60, "the job's grads to hang")
    os.kill(rank.p.pid, getattr(signal, sig))
    wait_for(lambda: "stopping in order (again to stop at once)" in rank.text(), 10, "the first signal's word")
    assert rank.p.poll() is None                      # (the ordered stop waits for the loop)
    os.kill(rank.p.pid, getattr(signal, sig))         # (the same signal again: at once, however quick)
    assert rank.p.wait(15) == code, rank.text()[-2000:]
    if sig == "SIGINT":
        assert "tabcohort rank: interrupted (Ctrl-C)" in rank.text(), rank.text()[-2000:]
        # (and no error-log line for it: "tabcohort.runtime ERROR rank ...: KeyboardInterrupt")
        assert "KeyboardInterrupt" not in rank.text(), rank.text()[-2000:]
    # (and the bus's socket closed on the way out: "asyncio ERROR Unclosed client session" was
    # the last line of every forced stop)
    assert "Unclosed" not in rank.text(), rank.text()[-2000:]


def test_a_job_whose_evaluate_starts_raising_ends_each_rank_with_the_job_s_line(cluster, tmp_path):
    # a new-user trial: evaluate() raising mid-run made every evaluation a round fault (a beat's
    # wait: 25 steps/s for 5,000) with a frozen accuracy and no word on the rank's console
    job = tmp_path / "eval_later.py"
    job.write_text(_evaluate_failing_later())
    cluster.serve("--job", str(job))
    ranks = [cluster.rank("--trust-job") for _ in range(2)]
    codes = [p.p.wait(60) for p in ranks]
    out = "".join(p.text() for p in ranks)
    assert "the job's evaluate() failed: KeyError: 'eval oops' (at eval_later.py:" in out, out[-2000:]
    assert "job failed: the job's evaluate() failed 3 times in a row" in out, out[-2000:]
    assert 1 in codes, codes


@pytest.mark.parametrize("how,expect", [
    ("nan", r"training diverged at step \d+: .*NaN in the job's loss or gradients"),
    ("raise", r"the job's compute failed 3 times in a row: RuntimeError: boom in grads \(at .*raise\.py:\d+ in grads\)"),
    # (it said "training diverged ... try a smaller --lr", and a real room stalled without a word)
    ("short", r"the job's compute failed 3 times in a row: JobError: .*grads\(\) returned 9 gradient values, "
              r"but the worker's bucket_len is 10 \(one per parameter, whatever the samples\) \(/"),
    # (a new-user trial: it trained on at a beat per evaluation and ended in a raw traceback)
    ("evaluate", r"the job's evaluate\(\) failed 3 times in a row: KeyError: 'eval oops' "
                 r"\(at evaluate\.py:\d+ in evaluate\)"),
    # (refused by the run's start-up check: a configuration error, exit 2)
    ("bucket_len", r"bucket_len 11 disagrees with params\(\), which has 10 values"),
])
def test_simulate_ends_a_job_that_goes_bad_with_an_error(tmp_path, how, expect):
    # simulate ran the raising job to --max-seconds and exited 0 with "bit-identical: yes"
    job = tmp_path / f"{how}.py"
    job.write_text(_evaluate_failing_later() if how == "evaluate"
                   else GOOD.replace("BUCKET_LEN, GRAD_LEN, LOSS = N, N,", "BUCKET_LEN, GRAD_LEN, LOSS = N + 1, N + 1,")
                   if how == "bucket_len" else _failing_later(how))
    r = subprocess.run([sys.executable, "-m", "tabcohort.cli", "simulate", "--job", str(job), "--ranks", "2",
                        "--steps", "500", "--max-seconds", "60", "--json"],
                       capture_output=True, text=True, timeout=120, env=_env(), cwd=str(ROOT))
    assert r.returncode == (2 if how == "bucket_len" else 1), (r.stdout[-1500:], r.stderr[-1500:])
    assert re.search(expect, r.stderr), r.stderr[-2000:]
    # under --json stdout is exactly one document saying why (a new-user trial: a job refused by
    # the run's start-up check printed two, and json.loads failed with "Extra data")
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and re.search(expect, doc["error"]), doc


def test_evaluate_names_the_dataset_it_was_given(cluster, tmp_path):
    """A model of the built-in job trained on an .npz, evaluated on a missing file or on other
    data under the same name: the error names --dataset (it said ``dataset=...``, and blamed a
    ``--job=.../builtin_mlp.py`` the user never gave)."""
    import numpy as np
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    data = tmp_path / "train" / "rows.npz"
    data.parent.mkdir()
    np.savez(data, X=x, y=y)
    cluster.serve("--dataset", str(data), "--steps", "30", "--checkpoint-interval", "1")
    p = cluster.rank()
    assert p.p.wait(120) == 0, p.text()
    wait_for(lambda: (c := cluster.state()["checkpoint"]) and c["final"] and c, 20, "the final checkpoint")
    model = tmp_path / "m.npz"
    model.write_bytes(_fetch(cluster, "/model"))

    def evaluate(*args):
        return subprocess.run([sys.executable, "-m", "tabcohort.cli", "evaluate", "--model", str(model), *args],
                              capture_output=True, text=True, timeout=120, env=_env(), cwd=str(ROOT))
    ok = evaluate("--dataset", str(data))
    assert ok.returncode == 0, ok.stderr
    missing = evaluate("--dataset", str(tmp_path / "none.npz"))
    assert missing.returncode == 2 and f"--dataset='{tmp_path / 'none.npz'}'" in missing.stderr, missing.stderr
    other = tmp_path / "other" / "rows.npz"
    other.parent.mkdir()
    np.savez(other, X=-x, y=y)
    bad = evaluate("--dataset", str(other))
    assert bad.returncode == 2 and "--dataset=" in bad.stderr and "not the data" in bad.stderr, bad.stderr
    assert "--job" not in bad.stderr
    # the model's own path to its data gone (evaluated elsewhere): the error says how to give it
    data.rename(tmp_path / "moved.npz")
    gone = evaluate()
    assert gone.returncode == 2 and "give the data file's path with --dataset PATH" in gone.stderr, gone.stderr


#: GOOD, reading its data from a file its LOCAL_OPTIONS name (README "Write your own job")
LOCAL_JOB = GOOD.replace('SPEC = {"name": "tiny"}\n', 'SPEC = {"name": "tiny"}\nOPTIONS = {"scale": 1.0}\n'
                         'LOCAL_OPTIONS = {"data_file": "rows.npz"}\n').replace(
    "def load_data():\n    import numpy as np\n",
    "def load_data(options):\n    import numpy as np\n    d = np.load(options['data_file'])\n"
    "    return {'x': d['x'], 'y': d['y']}\n").replace(
    "def make_worker(data, *, batch, seed, backend):", "def make_worker(data, *, batch, seed, backend, options):")


def test_evaluate_takes_the_local_options_a_model_was_trained_with(cluster, tmp_path):
    # a new-user trial: a model trained with --job-option data_file=ELSEWHERE (a LOCAL_OPTIONS
    # entry: not in the model) could not be evaluated: evaluate had no --job-option
    import numpy as np
    job = tmp_path / "localjob.py"
    job.write_text(LOCAL_JOB)
    x = np.array([[i % 2, (i // 2) % 2, 1, 0] for i in range(16)], dtype=np.float32)
    np.savez(tmp_path / "rows.npz", x=x, y=x[:, 0].astype(np.int32))
    np.savez(tmp_path / "other.npz", x=x[::-1].copy(), y=x[::-1, 0].astype(np.int32))
    cluster.serve("--job", str(job), "--job-option", f"data_file={tmp_path / 'other.npz'}", "--steps", "30",
                  "--checkpoint-interval", "1")
    p = cluster.rank("--trust-job")
    assert p.p.wait(120) == 0, p.text()
    wait_for(lambda: (c := cluster.state()["checkpoint"]) and c["final"] and c, 20, "the final checkpoint")
    model = tmp_path / "m.npz"
    model.write_bytes(_fetch(cluster, "/model"))

    def evaluate(*args):
        return subprocess.run([sys.executable, "-m", "tabcohort.cli", "evaluate", "--model", str(model), "--job",
                               str(job), *args], capture_output=True, text=True, timeout=120, env=_env(),
                              cwd=str(tmp_path))
    plain = evaluate()
    assert plain.returncode == 2 and "give it with --job-option NAME=VALUE" in plain.stderr, plain.stderr
    # (and which part of the job differs: it named "other code, data or spec", a new-user trial)
    assert "(its data differs from the model's)" in plain.stderr, plain.stderr
    ok = evaluate("--job-option", f"data_file={tmp_path / 'other.npz'}")
    assert ok.returncode == 0 and "held-out accuracy" in ok.stdout, ok.stderr
    changed = evaluate("--job-option", "scale=2.0")
    assert changed.returncode == 2 and "only LOCAL_OPTIONS may be given here" in changed.stderr, changed.stderr


def test_a_rank_asking_for_a_backend_the_job_lacks_is_refused_before_any_download(cluster, tmp_path):
    # a new-user trial: `rank --backend python` on a numpy-only job said `backend='python'` (no
    # dashes), after the job's data had downloaded; and TABCOHORT_TRUST_JOB=0 was named
    # TABCOHORT-TRUST-JOB
    job = tmp_path / "numpy_only.py"
    job.write_text(GOOD.replace('SPEC = {"name": "tiny"}', 'SPEC = {"name": "tiny"}\nBACKENDS = ("numpy",)'))
    cluster.serve("--job", str(job))
    p = cluster.rank("--trust-job", "--backend", "python")
    assert p.p.wait(60) == 2
    out = p.text()
    assert "--backend='python': the room's job 'tiny' runs on numpy" in out and "fetching" not in out, out
    env_rank = subprocess.run([sys.executable, "-m", "tabcohort.cli", "rank", "--server", cluster.url, "--room",
                               cluster.room], capture_output=True, text=True, timeout=60,
                              env={**_env(), "TABCOHORT_TRUST_JOB": "0"}, cwd=str(ROOT))
    assert env_rank.returncode == 2 and "TABCOHORT_TRUST_JOB=" in env_rank.stderr, env_rank.stderr


@pytest.mark.parametrize("command", [["simulate", "--ranks", "2", "--steps", "10"], ["serve", "--port", "0"]])
def test_ctrl_c_stops_a_start_up_check_that_does_not_return(tmp_path, command):
    """A job whose module never finishes importing (a new-user trial): the first Ctrl-C did
    nothing while the check waited (``asyncio.run``'s SIGINT handler only cancels a task), and
    the second exited 2 saying the 120 s bound had passed after 14 s. Now the first one stops
    it, exit 130, with no traceback; the bound itself is tests/unit/test_jobs.py's."""
    import os
    import signal
    marker = tmp_path / "importing"
    job = tmp_path / "sleeps_on_import.py"
    job.write_text(f"import pathlib, time\npathlib.Path({str(marker)!r}).write_text('')\ntime.sleep(600)\n"
                   "def make_worker(batch, seed):\n    raise RuntimeError('never reached')\n")
    # (SIGINT as a terminal leaves it: a shell that starts CI in the background ignores it, and an
    # ignored SIGINT stays ignored, tests/unit/test_jobs.py)
    p = subprocess.Popen([sys.executable, "-m", "tabcohort.cli", *command, "--job", str(job)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=str(ROOT),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(lambda: marker.exists(), 60, "the job's module to start importing")
        os.kill(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=15)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 130, (p.returncode, out[-2000:], err[-2000:])
    assert "Traceback" not in err and "did not finish within" not in err, err[-2000:]
    if command[0] == "simulate":   # (its one line: no rank had started)
        assert "stopped by Ctrl-C before the ranks started, after " in out, out[-2000:]
    else:                          # (it ended with no word at all)
        assert f"tabcohort {command[0]}: interrupted (Ctrl-C)" in err, err[-2000:]


def test_a_job_whose_bucket_holds_the_event_loop_too_long_is_told_why_and_what_to_do(tmp_path):
    # a new-user trial: a job whose grads() took 2 s a bucket never took a step, and simulate
    # blamed the cohort "still forming (n^2 deliveries)" for a single rank
    job = tmp_path / "slow.py"
    job.write_text(GOOD.replace("    def grads(self, offset, samples):\n",
                                "    def grads(self, offset, samples):\n"
                                "        import time; time.sleep(0.065 * samples)\n"))
    r = subprocess.run([sys.executable, "-m", "tabcohort.cli", "simulate", "--job", str(job), "--ranks", "1",
                        "--steps", "3", "--max-seconds", "8", "--json"],
                       capture_output=True, text=True, timeout=120, env=_env(), cwd=str(ROOT))
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["ok"] is False and doc["steps"] == 0, (doc, r.stderr[-1500:])
    # (the advice in simulate's terms: its --batch is no per-rank cap)
    assert re.search(r"the job's grads\(\) held the event loop for \d+\.\d s computing 32 samples, call after "
                     r"call .* cap it with --global-batch \d+", doc["error"]), doc["error"]
    assert "still forming" not in doc["error"]
