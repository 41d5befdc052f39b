"""Module jobs without a server (tabcohort.jobs; README "Write your own job", "Trust model"):
the stdlib .npz reader and writer, the code bundle a server serves and a rank unpacks, the job
hash, the worker wrapper, and what a native rank may run."""

from __future__ import annotations

import hashlib
import io
import math
import re
import sys
import zipfile
from array import array

import pytest

from tabcohort._compat import np
from tabcohort.errors import ConfigError
from tabcohort.jobs import (JobData, JobError, LoadedJob, find_source, load_bundle, load_job, probe,
                            source_bundle)
from tabcohort.jobs.arrays import ArrayFormatError, NdArray, npy_bytes, read_npz, write_npz
from tabcohort.runtime.session import trusted_job_source

JOB = '''\
from array import array
SPEC = {"name": "const"}


class W:
    backend = "python"

    def __init__(self, batch):
        self.batch, self.bucket_len, self.p = batch, 3, array("f", [1.0, 2.0, 3.0])

    def params(self):
        return array("f", self.p)

    def set_params(self, v):
        self.p = array("f", v)

    def grads(self, offset, samples):
        return 0.5, array("f", [1.0, 1.0, float(offset)])

    def evaluate(self):
        return 0.25


def make_worker(data, *, batch, seed, backend):
    return W(batch)
'''


def _run(coro):
    """A coroutine's result without an event loop (the Pyodide tier has none)."""
    from ._drive import drive
    return drive(coro)[0]


def _job(tmp_path, src=JOB, name="constjob.py"):
    p = tmp_path / name
    p.write_text(src)
    return str(p)


def test_npz_round_trip_is_deterministic_and_keeps_shapes():
    a = NdArray("<f4", (2, 3), array("f", [0.5, -1.0, 2.0, 3.0, 4.0, 1e-3]))
    b = NdArray("<i4", (4,), array("i", [1, -2, 3, 2**31 - 1]))
    raw = write_npz({"x": a, "y": b}, extra=[("job.json", b"{}")])
    assert raw == write_npz({"y": b, "x": a}, extra=[("job.json", b"{}")])   # same arrays, same bytes
    arrays, other = read_npz(raw)
    assert arrays["x"].shape == (2, 3) and list(arrays["x"].data) == list(a.data)
    assert arrays["y"].descr == "<i4" and list(arrays["y"].data) == [1, -2, 3, 2**31 - 1]
    assert other == {"job.json": b"{}"}
    # the header is padded to a multiple of 64 bytes (NEP 1, version 1.0)
    hlen = int.from_bytes(npy_bytes(a)[8:10], "little")
    assert (10 + hlen) % 64 == 0


@pytest.mark.needs_numpy
def test_npz_is_numpys_format_both_ways():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7
    arrays, _ = read_npz(write_npz({"x": x, "m": np.array([True, False])}))
    assert np.array_equal(arrays["x"].numpy(), x) and arrays["m"].descr == "|u1"
    with np.load(io.BytesIO(write_npz({"x": x}))) as z:
        assert np.array_equal(z["x"], x)
    buf = io.BytesIO()
    np.savez(buf, a=np.arange(5, dtype=np.int64), b=x)
    got, _ = read_npz(buf.getvalue())
    assert list(got["a"].data) == [0, 1, 2, 3, 4] and np.array_equal(got["b"].numpy(), x)


def test_bad_npz_members_are_refused():
    with pytest.raises(ArrayFormatError, match="not an .npz"):
        read_npz(b"not a zip")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        header = b"{'descr': '<c16', 'fortran_order': False, 'shape': (1,), }\n"
        z.writestr("x.npy", b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + bytes(16))
    with pytest.raises(ArrayFormatError, match="x.npy: dtype '<c16' is not supported"):
        read_npz(buf.getvalue())
    bad = npy_bytes(NdArray("<f4", (3,), array("f", [1, 2, 3])))[:-4]   # one value short
    with pytest.raises(ArrayFormatError, match="data bytes for shape"):
        from tabcohort.jobs.arrays import parse_npy
        parse_npy(bad)


def test_bundle_round_trip_keeps_the_code_hash(tmp_path):
    src = find_source(_job(tmp_path))
    assert src.module == "constjob" and src.factory == "make_worker"
    again = load_bundle(src.bundle, expect_sha256=src.code_sha256, cache_dir=str(tmp_path / "cache"))
    assert again.code_sha256 == src.code_sha256 and again.files == src.files
    with pytest.raises(JobError, match="sha256"):
        load_bundle(src.bundle, expect_sha256="0" * 64)
    evil = source_bundle("constjob", {"../escape.py": b"x = 1\n"}, "make_worker")
    with pytest.raises(JobError, match="bad file name"):
        load_bundle(evil, cache_dir=str(tmp_path / "cache2"))
    assert not (tmp_path / "escape.py").exists()


def test_a_factory_name_after_a_colon(tmp_path):
    path = _job(tmp_path, JOB + "\n\ndef other(data, *, batch, seed, backend):\n    return W(2 * batch)\n")
    job = load_job(f"{path}:other")
    w = job.make_worker(batch=4, seed=0, backend="python")
    assert w.batch == 8 and job.source.factory == "other"
    with pytest.raises(JobError, match=r"no function nope\(\)"):
        load_job(f"{path}:nope")


def test_job_hash_covers_code_data_and_spec(tmp_path):
    a = load_job(_job(tmp_path))
    w = probe(a, batch=4, seed=0, backend="python")
    h = a.job_hash(w)
    b = load_job(_job(tmp_path, JOB.replace('"const"', '"const2"'), name="constjob2.py"))
    assert b.job_hash(b.make_worker(batch=4, seed=0, backend="python")) != h      # spec and code
    c = LoadedJob(a.source, a.module, JobData.from_npz(write_npz({"x": NdArray("<f4", (1,), array("f", [1.0]))})))
    assert c.job_hash(w) != h                                                        # data
    assert len(h) == 32 and w.spec()["code_sha256"] == a.source.code_sha256


def test_job_worker_defaults(tmp_path):
    w = load_job(_job(tmp_path)).make_worker(batch=4, seed=0, backend="python")
    loss, g = w.grads_sync(7, 2)
    assert loss == 0.5 and list(g) == [1.0, 1.0, 7.0] and isinstance(g, array)
    w.apply(array("f", [1.0, 2.0, 4.0]), 0.5)          # no apply in the job: plain SGD in float32
    assert list(w.params()) == [0.5, 1.0, 1.0]
    assert math.isnan(w.evaluate_loss()) and w.evaluate() == 0.25


def test_a_data_hash_the_job_declares_is_checked(tmp_path):
    want = hashlib.sha256(b"").hexdigest()   # a job without load_data has the empty data
    assert load_job(_job(tmp_path, JOB + f"\nDATA_SHA256 = {want!r}\n")).data.sha256 == want


@pytest.mark.parametrize("returns,said", [
    ("{'x': 'hello'}", "load_data(): 'x': expected a numpy array or an NdArray, got str"),
    ("{'x y/..': NdArray('<f4', (1,), array('f', [1.0]))}", "its key 'x y/..' is not an identifier"),
    ("None", "load_data() must return a dict of identifier -> array, not NoneType"),
    ("{0: NdArray('<f4', (1,), array('f', [1.0]))}", "its key of type int is not a string"),
])
def test_a_bad_load_data_entry_is_named(tmp_path, returns, said):
    # (a new-user trial: a dict of many entries said only the bad one's type, and a bad key the
    # same text as returning None)
    src = JOB + ("\n\ndef load_data():\n    from array import array\n    from tabcohort.jobs.arrays import NdArray\n"
                 f"    return {returns}\n")
    with pytest.raises(JobError) as e:
        load_job(_job(tmp_path, src))
    assert said in str(e.value), e.value


def test_a_native_rank_runs_a_served_job_only_when_told(tmp_path):
    src = find_source(_job(tmp_path))
    info = {"name": "const", "code_sha256": src.code_sha256, "code_bytes": len(src.bundle)}
    with pytest.raises(ConfigError) as e:
        trusted_job_source(info, trust=False, local=None)
    assert e.value.variable == "--trust-job"
    # (it began "--trust-job=False: the room runs the job ...")
    assert str(e.value).startswith("this rank was not told to trust the room's job: the room runs the job 'const'")
    assert "--trust-job" in str(e.value) and "TABCOHORT_TRUST_JOB=1" in str(e.value) and "--job PATH" in str(e.value)
    assert trusted_job_source(info, trust=True, local=None) is None           # the server's code
    assert trusted_job_source(info, trust=False, local=_job(tmp_path)).code_sha256 == src.code_sha256
    (tmp_path / "edited").mkdir()
    other = _job(tmp_path, JOB + "# an edit\n", name="edited/constjob.py")
    with pytest.raises(ConfigError, match="is not the room's job 'const'") as e:
        trusted_job_source(info, trust=True, local=other)                     # a local copy must match
    assert e.value.variable == "--job"


def test_a_package_job_and_a_module_name(tmp_path, monkeypatch):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .model import make_worker\nSPEC = {'name': 'pkg'}\n")
    (pkg / "model.py").write_text(JOB)
    src = find_source(str(pkg))
    assert sorted(src.files) == ["mypkg/__init__.py", "mypkg/model.py"] and src.is_package
    job = load_job(str(pkg))
    assert job.name == "pkg" and job.make_worker(batch=2, seed=0, backend="python").bucket_len == 3
    # the bundle of a package unpacks and imports elsewhere (relative imports included)
    again = load_bundle(src.bundle, cache_dir=str(tmp_path / "cache"))
    assert again.is_package and again.import_module().SPEC == {"name": "pkg"}
    monkeypatch.syspath_prepend(str(tmp_path))
    assert find_source("mypkg").code_sha256 == src.code_sha256        # by module name: the same files
    with pytest.raises(JobError, match="no such file"):
        find_source("no_such_job_module_here")


def test_a_job_workers_local_steps_sync_and_async_agree_and_leave_its_parameters_alone(tmp_path):
    from ._drive import drive
    w = load_job(_job(tmp_path)).make_worker(batch=4, seed=0, backend="python")
    # SGD at lr 0.5 over grads (1, 1, offset): 3 inner steps at offsets 10, 12, 14
    loss, pg = w.local_grads_sync(10, 2, 3, "sgd", 0.5)
    assert loss == 0.5 and list(pg) == [1.5, 1.5, 18.0]          # 0.5 * sum of the inner grads
    assert list(w.params()) == [1.0, 2.0, 3.0]                   # the worker's own parameters unchanged
    (loss_a, pg_a), n_yields = drive(w.local_grads(10, 2, 3, "sgd", 0.5))
    assert (loss_a, list(pg_a)) == (loss, list(pg)) and n_yields >= 2   # it yields between inner steps
    calls = []
    assert drive(w.local_grads(10, 2, 3, "sgd", 0.5, should_stop=lambda: calls.append(1) or True))[0] is None
    assert calls == [1]                                          # abandoned after the first inner step


def test_a_rank_refuses_served_data_or_code_that_is_not_the_rooms_job(tmp_path):
    """A rank builds a served job's worker only from data whose sha256 is the job's and code
    whose job hash is the server's (a proxy or cache that altered either is refused, never trained)."""
    from tabcohort.errors import TabcohortError
    from tabcohort.runtime.session import make_module_worker
    data = write_npz({"x": NdArray("<f4", (2,), array("f", [1.0, 2.0]))})
    src = find_source(_job(tmp_path))
    loaded = LoadedJob(src, src.import_module(), JobData.from_npz(data))
    w = loaded.make_worker(batch=4, seed=0, backend="python")
    from tabcohort.protocol.optim import TrainConfig
    job = {"job_info": {"data_sha256": hashlib.sha256(data).hexdigest()}, "batch": 4, "seed": 0, "bucket_len": 3}
    job["job_hash"] = loaded.job_hash(w, TrainConfig.from_job(job).spec())
    assert _run(make_module_worker(job, loaded.source, data, batch=None, backend="python"))[1] == job["job_hash"]
    other = write_npz({"x": NdArray("<f4", (2,), array("f", [1.0, 2.5]))})
    with pytest.raises(TabcohortError, match="the job's data sha256 [0-9a-f]{64} != the job's"):
        _run(make_module_worker(job, loaded.source, other, batch=None, backend="python"))
    with pytest.raises(TabcohortError, match="!= the server's .*different job code or data"):
        _run(make_module_worker({**job, "job_hash": "0" * 32}, loaded.source, data, batch=None,
                                       backend="python"))


OPTIONS_JOB = JOB.replace('SPEC = {"name": "const"}', 'SPEC = {"name": "const"}\nOPTIONS = {"scale": 1.0}\n'
                          'BACKENDS = ("auto", "python", "gpu")\n').replace(
    "def make_worker(data, *, batch, seed, backend):\n    return W(batch)",
    "def load_data(options):\n    from array import array\n    from tabcohort.jobs.arrays import NdArray\n"
    "    return {'s': NdArray('<f4', (1,), array('f', [options['scale']]))}\n\n\n"
    "def make_worker(data, *, batch, seed, backend, options):\n    w = W(batch)\n    w.backend = backend\n"
    "    w.p = array('f', [v * data['s'].data[0] for v in w.p])\n"
    "    if backend == 'gpu':\n        async def later():\n            return w\n        return later()\n    return w")


def test_job_options_reach_load_data_and_the_factory_and_the_job_hash(tmp_path):
    """``OPTIONS``: defaults overridden by the server's values, passed to ``load_data(options)``
    and the factory, part of the spec (so of the job hash); an unknown name is refused."""
    path = _job(tmp_path, OPTIONS_JOB, name="optjob.py")
    a, b = load_job(path), load_job(path, options={"scale": 2.0})
    wa, wb = a.make_worker(batch=4, seed=0, backend="python"), b.make_worker(batch=4, seed=0, backend="python")
    assert list(wa.params()) == [1.0, 2.0, 3.0] and list(wb.params()) == [2.0, 4.0, 6.0]
    assert b.spec == {"name": "const", "options": {"scale": 2.0}} and a.job_hash(wa) != b.job_hash(wb)
    # LOCAL_OPTIONS reach load_data only: not in the spec, so not in the job hash
    local = _job(tmp_path, OPTIONS_JOB.replace("OPTIONS = {\"scale\": 1.0}", "OPTIONS = {\"scale\": 1.0}\n"
                                               "LOCAL_OPTIONS = {\"where\": None}").replace(
        "def load_data(options):\n", "def load_data(options):\n    assert options['where'] == 'here'\n"), name="locjob.py")
    c = load_job(local, options={"scale": 2.0, "where": "here"})
    assert c.spec == b.spec and c.options == {"scale": 2.0}
    with pytest.raises(JobError, match="no such option size .*the job's options: scale"):
        load_job(path, options={"size": 3})
    with pytest.raises(JobError, match="takes no options"):
        load_job(_job(tmp_path), options={"scale": 2.0})
    # a name in both: load_data got the local value, the factory and the hash the other
    both = _job(tmp_path, OPTIONS_JOB.replace("OPTIONS = {\"scale\": 1.0}", "OPTIONS = {\"scale\": 1.0}\n"
                                              "LOCAL_OPTIONS = {\"scale\": 3.0}"), name="bothjob.py")
    with pytest.raises(JobError, match="scale is in both OPTIONS and LOCAL_OPTIONS"):
        load_job(both)


def test_a_job_option_of_another_type_than_its_default_is_refused_naming_it(tmp_path):
    # a new-user trial: hidden=32.5 for a default of 32, or "32" in quotes, reached the job's own
    # code, whose error named neither the option nor what it takes
    src = OPTIONS_JOB.replace('OPTIONS = {"scale": 1.0}', 'OPTIONS = {"scale": 1.0, "hidden": 32, "layers": [8, 4], '
                              '"name": "a", "on": True, "extra": None}')
    path = _job(tmp_path, src, name="typedjob.py")
    for k, v, what in (("hidden", 32.5, "is a whole number"), ("hidden", "32", "is a whole number"),
                       ("hidden", True, "is a whole number"), ("scale", "2", "is a number"),
                       ("layers", 8, "is a list, e.g. \\[64, 32\\]"), ("layers", [8, 4.5], "is a list of whole numbers"),
                       ("name", 3, "is a string .in JSON quotes, e.g. .*. in a shell."), ("on", 1, "is true or false")):
        with pytest.raises(ConfigError, match=f"the job's option {k} {what} .its default: "):
            load_job(path, options={k: v})
    # (the hint about fractional numbers only for a number given to a whole-number option)
    with pytest.raises(ConfigError, match=r"may be fractional says so in its default, e.g. 1.0"):
        load_job(path, options={"hidden": 32.5})
    with pytest.raises(ConfigError) as e:
        load_job(path, options={"on": 1})
    assert "fractional" not in e.value.reason
    ok = load_job(path, options={"hidden": 16, "scale": 2, "layers": [], "name": "b", "on": False, "extra": [1]})
    assert ok.options["hidden"] == 16 and ok.options["scale"] == 2
    if np is not None:   # (the Python API may be given a numpy number: refused by name, not a TypeError)
        with pytest.raises(ConfigError, match=r"the job's option hidden is a whole number"):
            load_job(path, options={"hidden": np.float64(2.5)})


def test_a_grads_call_that_holds_the_loop_twice_in_a_row_is_noted_not_a_slow_first_one(tmp_path, monkeypatch):
    import tabcohort.jobs.worker as jw
    job = load_job(_job(tmp_path))
    w = job.make_worker(batch=4, seed=0, backend="python")
    clock = iter([0.0, 0.9, 1.0, 1.1, 2.0, 2.9, 3.0, 3.8])   # calls of 0.9, 0.1, 0.9, 0.8 s
    monkeypatch.setattr(jw.time, "perf_counter", lambda: next(clock))
    for _ in range(3):
        _run(w.grads(0, 32))
        assert w.slow_call is None            # a slow first call, then a fast one: no habit
    _run(w.grads(0, 32))
    assert w.slow_call == (pytest.approx(0.8), 32)
    note = jw.slow_call_note(w.slow_call, flag="--global-batch", ranks=2)
    assert "held the event loop for 0.8 s computing 32 samples" in note and "--global-batch 20" in note
    assert "one sample takes" in jw.slow_call_note((2.0, 1))


def test_a_job_that_lists_its_backends_gets_them_as_asked_and_may_build_asynchronously(tmp_path):
    job = load_job(_job(tmp_path, OPTIONS_JOB, name="optjob.py"))
    assert job.make_worker(batch=4, seed=0, backend="auto").backend == "auto"      # the job chooses
    if sys.platform == "emscripten":   # no loop runs to its end there: a tab builds asynchronously
        with pytest.raises(JobError, match="is asynchronous, and no event loop"):
            job.make_worker(batch=4, seed=0, backend="gpu")
    else:   # awaited to its end (README: a factory may return an awaitable of its worker)
        assert job.make_worker(batch=4, seed=0, backend="gpu").backend == "gpu"

        async def in_a_running_loop():   # (simulate builds its ranks on its loop: a thread then)
            return job.make_worker(batch=4, seed=0, backend="gpu")
        import asyncio
        assert asyncio.run(in_a_running_loop()).grads_sync(3, 1)[0] == 0.5
    w = _run(job.make_worker_async(batch=4, seed=0, backend="gpu"))
    assert w.backend == "gpu" and w.grads_sync(3, 1)[0] == 0.5
    # local steps build their scratch worker through the same asynchronous factory
    loss, pg = _run(w.local_grads(10, 2, 3, "sgd", 0.5))
    assert loss == 0.5 and list(pg) == [1.5, 1.5, 18.0]
    from tabcohort.errors import LocalProtocolError
    with pytest.raises(LocalProtocolError, match="asynchronous"):
        _run(job.make_worker_async(batch=4, seed=0, backend="gpu")).local_grads_sync(10, 2, 3, "sgd", 0.5)
    with pytest.raises(ConfigError, match="runs on auto, python, gpu"):
        job.make_worker(batch=4, seed=0, backend="numpy")
    with pytest.raises(ConfigError, match="expected one of auto, numpy, python"):   # a job without BACKENDS
        load_job(_job(tmp_path)).make_worker(batch=4, seed=0, backend="gpu")


def test_a_numpy_only_job_without_numpy_says_so_before_its_factory_runs(tmp_path, monkeypatch):
    # a new-user trial: a tab without numpy called the factory of a job listing BACKENDS =
    # ("numpy",), which raised "No module named 'numpy'" from the job's own file
    import tabcohort.jobs as jobs
    src = JOB.replace('SPEC = {"name": "const"}', 'SPEC = {"name": "const"}\nBACKENDS = ("numpy",)\nCALLED = []')
    src = src.replace("    return W(batch)", "    CALLED.append(backend)\n    return W(batch)")
    job = load_job(_job(tmp_path, src, name="numpyonly.py"))
    monkeypatch.setattr(jobs, "np", None)
    for asked in ("auto", "numpy"):
        with pytest.raises(ConfigError, match=r"numpy is not importable here .* the job 'const' runs on numpy "
                                              r"\(its BACKENDS\)"):
            job.make_worker(batch=4, seed=0, backend=asked)
    assert job.module.CALLED == []
    # a job listing another backend too gets that one when numpy is missing
    job2 = load_job(_job(tmp_path, src.replace('("numpy",)', '("numpy", "js")'), name="numpyjs.py"))
    job2.make_worker(batch=4, seed=0, backend="auto")
    assert job2.module.CALLED == ["js"]
    # a job that lists "auto" chooses for itself, numpy asked for or not (the built-in job falls
    # back as auto would: tests/browser/test_tab_backends.py)
    job3 = load_job(_job(tmp_path, src.replace('("numpy",)', '("auto", "numpy", "python")'), name="numpyauto.py"))
    job3.make_worker(batch=4, seed=0, backend="numpy")
    assert job3.module.CALLED == ["numpy"]


def test_the_builtin_mlp_is_a_job_that_ships_and_needs_no_trust():
    """The built-in MLP is a module job like any other (tabcohort.jobs.BUILTIN): its options
    build the same MLP as tabcohort.model over the same data, and a rank runs it from its own
    copy, with no --trust-job, exactly when the room's code hash is that copy's."""
    from tabcohort.jobs import BUILTIN, shipped_source
    from tabcohort.model import load_dataset, make_worker
    job = load_job(BUILTIN, options={"dataset": "synthetic", "hidden": [16], "data_seed": 3})
    w = probe(job, batch=8, seed=5, backend="python")
    ref = make_worker(load_dataset("synthetic", seed=3), hidden=(16,), batch=8, seed=5, backend="python")
    assert w.model == ref.model and list(w.params()) == list(ref.params())
    assert list(w.grads_sync(11, 8)[1]) == list(ref.grads_sync(11, 8)[1]) and w.train_len == ref.dataset.train_len
    own = shipped_source(job.source.code_sha256)
    assert own is not None and own.code_sha256 == job.source.code_sha256
    info = {"name": "mlp", "code_sha256": job.source.code_sha256, "code_bytes": 1, "builtin": True}
    assert trusted_job_source(info, trust=False, local=None).code_sha256 == job.source.code_sha256
    with pytest.raises(ConfigError, match="the server runs other tabcohort code"):   # another version's built-in job
        trusted_job_source({**info, "code_sha256": "0" * 64}, trust=False, local=None)
    assert trusted_job_source({**info, "code_sha256": "0" * 64}, trust=True, local=None) is None


def test_the_probe_computes_a_small_bucket_whatever_the_rooms_batch(monkeypatch):
    """``serve --global-batch 200000`` probes the job before it serves: one bucket of at most
    PROBE_SAMPLES samples, not the whole batch (which took a minute on the pure-Python path)."""
    from tabcohort.jobs import BUILTIN, PROBE_SAMPLES
    from tabcohort.jobs.worker import JobWorker
    seen = []
    real = JobWorker.grads_sync

    def spy(self, offset, samples=None):
        seen.append(samples)
        return real(self, offset, samples)
    monkeypatch.setattr(JobWorker, "grads_sync", spy)
    job = load_job(BUILTIN, options={"dataset": "synthetic", "hidden": [16], "data_seed": 3})
    w = probe(job, batch=200_000, seed=0, backend="python")
    assert seen == [PROBE_SAMPLES] and w.batch == 200_000
    seen.clear()
    probe(job, batch=3, seed=0, backend="python")
    assert seen == [3]


def test_a_jobs_backends_spec_and_own_errors_are_checked(tmp_path):
    """``BACKENDS`` without ``auto``: auto picks numpy (when importable and listed), else python,
    else the first listed; ``BACKENDS`` that is not a tuple of names and a ``SPEC["options"]``
    (the key that holds ``OPTIONS``) are refused; a ``ConfigError`` the job raises itself (it
    names its setting) reaches the user as it is."""
    from tabcohort._compat import np as _np
    two = load_job(_job(tmp_path, OPTIONS_JOB.replace('("auto", "python", "gpu")', '("numpy", "python")'),
                        name="twob.py"))
    want = "numpy" if _np is not None else "python"
    assert two._backend("auto") == want and two.make_worker(batch=2, seed=0, backend="auto").backend == want
    for bad in ('"python"', "()", "(1, 2)"):
        with pytest.raises(JobError, match="BACKENDS must be a tuple of backend names"):
            load_job(_job(tmp_path, OPTIONS_JOB.replace('("auto", "python", "gpu")', bad), name="badb.py"))
    with pytest.raises(JobError, match="SPEC has a key 'options'"):
        load_job(_job(tmp_path, OPTIONS_JOB.replace('SPEC = {"name": "const"}', 'SPEC = {"name": "c", "options": 1}'),
                      name="specopt.py"))
    # (a 300-character name: every hello failed to encode, every report was dropped as bad_report.model)
    for name in ("x" * 65, "two\\nlines"):
        with pytest.raises(JobError, match="must be at most 64 printable characters"):
            load_job(_job(tmp_path, OPTIONS_JOB.replace('SPEC = {"name": "const"}', f'SPEC = {{"name": "{name}"}}'),
                          name="longname.py"))
    assert load_job(_job(tmp_path, OPTIONS_JOB.replace('SPEC = {"name": "const"}', f'SPEC = {{"name": "{"x" * 64}"}}'),
                         name="okname.py")).name == "x" * 64
    # a job's own exception message of any length is quoted cut (serve printed 10 KB on one line)
    with pytest.raises(JobError, match=r"x{500}\.\.\. \(9500 more characters\) \(.*longexc\.py:\d+\)") as e:
        load_job(_job(tmp_path, "raise RuntimeError('x' * 10000)\n" + OPTIONS_JOB, name="longexc.py"))
    assert len(str(e.value)) < 1000
    own = OPTIONS_JOB.replace("def load_data(options):\n", "def load_data(options):\n"
                              "    from tabcohort.errors import ConfigError\n"
                              "    raise ConfigError('scale', options['scale'], 'must be positive')\n")
    with pytest.raises(ConfigError) as e:
        load_job(_job(tmp_path, own, name="ownerr.py"), options={"scale": -1})
    assert not isinstance(e.value, JobError) and e.value.variable == "scale" and "must be positive" in str(e.value)


def test_the_builtin_job_refuses_a_model_too_large_for_a_checkpoint_before_building_it():
    from tabcohort.jobs import BUILTIN
    job = load_job(BUILTIN, options={"dataset": "synthetic", "hidden": [100_000_000]})
    with pytest.raises(ConfigError, match=r"would have [\d,]+ parameters .*at most 67,108,864") as e:
        job.make_worker(batch=8, seed=0, backend="python")
    assert e.value.variable == "hidden"
    import os
    from tabcohort.jobs.builtin_mlp import canonical
    # an .npz path: the file name is the job's (hashed, published), the path the server's own
    assert canonical({"dataset": "d/x.npz"}) == {"dataset": "npz:x.npz", "dataset_path": os.path.abspath("d/x.npz")}
    assert canonical({"dataset": "digits"}) == {"dataset": "digits"}


def test_a_workers_own_local_steps_are_used_only_when_it_has_both_forms(tmp_path):
    """JobWorker uses the job's worker's own local steps only when it has an awaitable
    ``local_grads`` and a ``local_grads_sync`` (tabcohort's MLP workers); a lone or synchronous
    ``local_grads`` is not the contract, and the generic inner loop runs instead."""
    from tabcohort.jobs.worker import JobWorker
    lone = JOB.replace("    def evaluate(self):", "    def local_grads(self, *a, **k):\n        raise AssertionError('not mine')\n\n"
                       "    def evaluate(self):")
    w = load_job(_job(tmp_path, lone, name="lonejob.py")).make_worker(batch=4, seed=0, backend="python")
    assert list(w.local_grads_sync(10, 2, 3, "sgd", 0.5)[1]) == [1.5, 1.5, 18.0]
    assert JobWorker(w.inner, backend="python", spec={}, model="m", batch=4).train_len is None


def test_the_code_hash_is_the_same_on_every_machine(tmp_path, monkeypatch):
    """The bundle is the same bytes whatever the host: stored (no zlib build in it), unix
    creator and mode (Python writes 0 = MS-DOS on Windows), LF line endings (a Windows checkout
    with CRLF is the same code)."""
    import sys as _sys
    from tabcohort.jobs import BUILTIN
    here = find_source(BUILTIN).code_sha256
    monkeypatch.setattr(_sys, "platform", "win32")
    assert find_source(BUILTIN).code_sha256 == here
    monkeypatch.undo()
    (tmp_path / "crlf").mkdir()
    lf = find_source(_job(tmp_path))
    (tmp_path / "crlf" / "constjob.py").write_bytes(JOB.replace("\n", "\r\n").encode())
    assert find_source(str(tmp_path / "crlf" / "constjob.py")).code_sha256 == lf.code_sha256
    with zipfile.ZipFile(io.BytesIO(lf.bundle)) as z:
        assert all(i.compress_type == zipfile.ZIP_STORED and i.create_system == 3 for i in z.infolist())


def test_a_module_that_is_not_python_source_is_named_as_such():
    # `--job os` said "no such file, package directory or importable module" (os is frozen)
    with pytest.raises(JobError, match="importable but not from a .py file"):
        find_source("sys")
    with pytest.raises(JobError, match="no such file, package directory or importable module"):
        find_source("no_such_module_anywhere_x")


def test_a_job_whose_grads_never_return_fails_the_start_up_check_within_its_timeout(monkeypatch):
    """A new user's job that blocked in grads() hung ``serve`` and ``simulate`` before they said
    anything; the start-up check now names the call still running when its time is up."""
    import sys
    import threading
    import time
    from tabcohort.jobs import BUILTIN, JobError
    from tabcohort.jobs.worker import JobWorker
    job = load_job(BUILTIN, options={"dataset": "synthetic", "hidden": [4], "data_seed": 3})
    if sys.platform != "emscripten":     # (Pyodide has no threads: the checks run inline there)
        release = threading.Event()
        monkeypatch.setattr(JobWorker, "grads_sync", lambda self, offset, samples=None: release.wait(60))
        t0 = time.monotonic()
        try:
            with pytest.raises(JobError, match=r"did not finish within 0.5 s: grads\(0\) has not returned"):
                probe(job, batch=8, seed=0, backend="python", timeout_s=0.5)
            assert time.monotonic() - t0 < 10
        finally:
            release.set()
    # a check that fails on the thread (or inline, without threads) raises on the caller's
    monkeypatch.setattr(JobWorker, "grads_sync", lambda self, offset, samples=None: (float("nan"), [0.0]))
    with pytest.raises(JobError):
        probe(job, batch=8, seed=0, backend="python", timeout_s=30)


def test_two_paths_of_a_job_must_agree_on_one_batch(tmp_path):
    """serve and simulate compare a job's numpy and pure-Python paths (tabs without numpy take
    the pure one): a path with the gradient's sign flipped trained a mixed cohort wrong, unsaid."""
    from tabcohort.jobs import compare_paths
    src = JOB.replace("return 0.5, array(\"f\", [1.0, 1.0, float(offset)])",
                      "return 0.5, array(\"f\", [self.sign, 1.0, float(offset) + 1.0])")
    src = src.replace("    return W(batch)", "    w = W(batch)\n    w.sign = -1.0 if seed == 1 else 1.0\n    return w")
    job = load_job(_job(tmp_path, src, name="signs.py"), with_data=False)
    same, flipped = (job.make_worker(batch=4, seed=s, backend="python") for s in (0, 1))
    assert compare_paths(job, same, job.make_worker(batch=4, seed=0, backend="python")) is None
    with pytest.raises(JobError, match=r"its numpy and pure-Python paths disagree on the same 4 samples and "
                                       r"parameters \(loss 0.5 and 0.5; the gradients differ by 1.15 of"):
        compare_paths(job, same, flipped)
    # a stochastic path (two results on one batch differ) is not compared, and says so (a review:
    # a job with dropout was refused although a mixed cohort trains it right)
    coin = src.replace("        return 0.5, array(", "        self.sign = -self.sign\n        return 0.5, array(")
    job = load_job(_job(tmp_path, coin, name="coin.py"), with_data=False)
    a, b = (job.make_worker(batch=4, seed=0, backend="python") for _ in range(2))
    assert "a path's two results on the same batch differ" in compare_paths(job, a, b)


def test_a_path_that_raises_while_the_paths_are_compared_is_a_job_error_naming_the_path_and_line(tmp_path):
    # a new-user trial: a job whose pure-Python path raised (or whose numpy path failed only on
    # the arrays set_params() is given there) ended simulate and serve with a traceback
    from tabcohort.jobs import compare_paths
    src = JOB.replace("    def grads(self, offset, samples):\n",
                      "    def grads(self, offset, samples):\n"
                      "        if self.path == 'python':\n"
                      "            raise NotImplementedError('python path todo')\n")
    src = src.replace("    return W(batch)", "    w = W(batch)\n    w.path = 'python' if seed == 1 else 'numpy'\n    return w")
    assert src.count("NotImplementedError") == 1 and "w.path" in src
    job = load_job(_job(tmp_path, src, name="halfdone.py"), with_data=False)
    numpy_like, python = (job.make_worker(batch=4, seed=s, backend="python") for s in (0, 1))
    with pytest.raises(JobError, match=r"the worker's grads\(0\) \(pure-Python path\) raised NotImplementedError: "
                                       r"python path todo \(.*halfdone.py:\d+\)"):
        compare_paths(job, numpy_like, python)


def test_a_grads_that_changes_the_parameters_never_starts(tmp_path):
    # a new-user trial: a grads() that also stepped its parameters (a training loop's habit) was
    # told its paths "differ (a stochastic job)" and trained on
    src = JOB.replace("        return 0.5, array(\"f\", [1.0, 1.0, float(offset)])",
                      "        self.p = array(\"f\", [x - 0.1 for x in self.p])\n"
                      "        return 0.5, array(\"f\", [1.0, 1.0, float(offset)])")
    assert src != JOB
    with pytest.raises(JobError, match=r"grads\(0\) changed the parameters \(params\(\)\[0\] was 1 before it, "
                                       r"0.9 after\)"):
        probe(load_job(_job(tmp_path, src, name="stepper.py")), batch=4, seed=0)
    # one that nudges them and puts them back (finite differences) may leave a last bit changed: no bug
    fd = JOB.replace("        return 0.5, array(\"f\", [1.0, 1.0, float(offset)])",
                     "        self.p = array(\"f\", [x + 1e-3 for x in self.p])\n"
                     "        self.p = array(\"f\", [x - 1e-3 for x in self.p])\n"
                     "        return 0.5, array(\"f\", [1.0, 1.0, float(offset)])")
    assert fd != JOB
    from array import array
    assert array("f", [x - 1e-3 for x in array("f", [x + 1e-3 for x in (1.0, 2.0, 3.0)])]) != array("f", [1, 2, 3])
    probe(load_job(_job(tmp_path, fd, name="nudge.py")), batch=4, seed=0)


def test_a_one_file_job_that_imports_a_file_beside_it_is_refused_as_ranks_would_refuse_it(tmp_path, monkeypatch):
    """Ranks import a job from its bundle alone; under `python -m tabcohort` the job's directory
    (the current one) was on sys.path, so serve's check imported the file beside it and accepted
    a job that failed on every rank."""
    (tmp_path / "helper_beside.py").write_text("ONE = 1\n")
    path = _job(tmp_path, "from helper_beside import ONE\n" + JOB, name="uses_helper.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend("")
    sys.modules.pop("helper_beside", None)
    with pytest.raises(JobError, match=r"No module named 'helper_beside'.*helper_beside is beside the job "
                                       r"but not part of it: a job of several files is a package"):
        load_job(path, with_data=False)
    assert "" in sys.path                              # (the caller's path is put back)
    # imported later, in grads(): the probe runs as a rank would too (a review)
    lazy = _job(tmp_path, JOB.replace("    def grads(self, offset, samples):\n",
                                      "    def grads(self, offset, samples):\n        import helper_beside\n"),
                name="lazy_helper.py")
    sys.modules.pop("helper_beside", None)
    job = load_job(lazy, with_data=False)
    with pytest.raises(JobError, match=r"grads\(0\) raised ModuleNotFoundError: No module named 'helper_beside'.*"
                                       r"helper_beside is beside the job but not part of it"):
        probe(job, batch=2, seed=0, backend="python")
    assert "" in sys.path


def test_a_job_whose_module_never_finishes_importing_fails_the_bounded_load(tmp_path):
    """A job that slept at its top level hung ``serve`` and ``simulate`` with nothing printed
    (the bound covered the calls after the import only)."""
    import sys
    import time
    from tabcohort.jobs import JobError
    if sys.platform == "emscripten":     # (Pyodide has no threads: the load runs inline, unbounded)
        return
    flag = tmp_path / "release"
    (tmp_path / "hangs_on_import.py").write_text(
        "import os, time\n"
        f"while not os.path.exists({str(flag)!r}):\n    time.sleep(0.01)\n"
        "def make_worker(batch, seed):\n    raise RuntimeError('never reached')\n")
    t0 = time.monotonic()
    try:
        with pytest.raises(JobError, match=r"did not finish within 0.5 s: importing the job's module has not "
                                           r"returned \(its top level must define things"):
            load_job(str(tmp_path / "hangs_on_import.py"), timeout_s=0.5)
        assert time.monotonic() - t0 < 10
    finally:
        flag.write_text("")


def test_a_bounded_load_keeps_the_jobs_main_thread_state_and_the_callers_signals(tmp_path):
    """The bounded import runs on the caller's (main) thread: a job that installs a signal handler
    at import was refused ("signal only works in main thread") and per-thread state it set was
    lost on a helper thread; an ignored SIGINT stays ignored, and a timer already armed (e.g.
    pytest-timeout's) is re-armed with what was left of it."""
    import signal
    import sys
    from tabcohort.jobs import run_bounded
    if sys.platform == "emscripten":     # (no signals or threads to speak of in Pyodide)
        return
    (tmp_path / "sets_a_handler.py").write_text(
        "import signal\nsignal.signal(signal.SIGUSR1, lambda *a: None)\n"
        "def make_worker(batch, seed):\n    raise RuntimeError('never reached')\n")
    before = signal.getsignal(signal.SIGUSR1)
    try:
        load_job(str(tmp_path / "sets_a_handler.py"), timeout_s=30)
        assert signal.getsignal(signal.SIGUSR1) is not before
    finally:
        signal.signal(signal.SIGUSR1, before)
    prev_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    old = signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        seen = []
        run_bounded(lambda: seen.append(signal.getsignal(signal.SIGINT)), timeout_s=5, doing=["x"], ref="r")
        run_bounded(lambda: seen.append(signal.getsignal(signal.SIGINT)), timeout_s=5, doing=["x"], ref="r",
                    on_main_thread=True)
        assert seen == [signal.SIG_IGN, signal.SIG_IGN]
        signal.setitimer(signal.ITIMER_REAL, 100.0)
        run_bounded(lambda: None, timeout_s=5, doing=["x"], ref="r", on_main_thread=True)
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 90 < left <= 100, left
    finally:
        signal.setitimer(signal.ITIMER_REAL, *old)
        signal.signal(signal.SIGINT, prev_int)


def test_a_copy_of_the_rooms_job_under_another_name_is_told_what_to_rename(tmp_path):
    # a new-user trial: a byte-identical copy saved as another file was refused as "another job,
    # or another version of it" (the code hash covers the module and factory names)
    room = find_source(_job(tmp_path, name="constjob.py"))
    info = {"name": "const", "module": room.module, "factory": room.factory, "code_sha256": room.code_sha256}
    (tmp_path / "copy").mkdir()
    copy = tmp_path / "copy" / "my_copy.py"
    copy.write_bytes((tmp_path / "constjob.py").read_bytes())
    with pytest.raises(ConfigError, match=r"under another name: its module is 'constjob' .*name the copy "
                                          r"constjob\.py and pass --job PATH"):
        trusted_job_source(info, trust=False, local=str(copy))
    copy.write_bytes((tmp_path / "constjob.py").read_bytes() + b"\n# edited\n")   # really another version
    with pytest.raises(ConfigError, match="another job, or another version of it"):
        trusted_job_source(info, trust=False, local=str(copy))
    assert trusted_job_source(info, trust=False, local=str(tmp_path / "constjob.py")).code_sha256 == room.code_sha256


@pytest.mark.parametrize("name,why", [("tabcohort", "tabcohort's own"), ("asyncio", "the imported module"),
                                      ("random", "the imported module")])
def test_a_job_named_like_a_module_the_process_uses_is_told_to_rename_it(tmp_path, name, why):
    # a new-user trial: a first job saved as tabcohort.py (or asyncio.py, numpy.py, random.py)
    # replaced that module in the process: tracebacks from inside tabcohort or the factory
    with pytest.raises(JobError, match=f"the job's module name '{name}' is .*{why}.*rename the file"):
        load_job(_job(tmp_path, name=f"{name}.py"))
    assert sys.modules[name].__name__ == name and getattr(sys.modules[name], "__file__", "") != str(tmp_path / f"{name}.py")


def test_a_job_named_like_a_standard_module_nothing_here_uses_still_loads(tmp_path):
    # (a review: every standard-library name was refused, code.py and profile.py too, and the
    # module name is part of the job's hash: renaming would cost a room its checkpoints)
    name = next(n for n in ("tabnanny", "profile", "trace", "code") if n not in sys.modules)
    assert load_job(_job(tmp_path, name=f"{name}.py")).name == "const"


def test_a_worker_whose_set_params_does_nothing_never_starts(tmp_path):
    # a new-user trial: set_params() that did nothing passed every check; the ranks "trained",
    # the loss never moved, and the run ended "bit-identical: yes"
    src = JOB.replace("def set_params(self, v):", "def set_params(self, v):\n        return\n\n    def _unused(self, v):")
    assert src != JOB
    with pytest.raises(JobError, match=r"set_params\(v\) does not set the parameters"):
        probe(load_job(_job(tmp_path, src, name="noop.py")), batch=4, seed=0)
    w = probe(load_job(_job(tmp_path)), batch=4, seed=0)          # a good one: its parameters as they were
    assert list(w.params()) == list(load_job(_job(tmp_path)).make_worker(batch=4, seed=0).params())
    # a job that keeps its weights in half precision rounds what it is given, and is no bug
    half = JOB.replace('        self.p = array("f", v)',
                       '        import struct\n'
                       '        self.p = array("f", [struct.unpack("e", struct.pack("e", x))[0] for x in v])')
    assert half != JOB
    probe(load_job(_job(tmp_path, half, name="half.py")), batch=4, seed=0)


def test_a_factory_name_that_is_not_a_function_says_what_it_is(tmp_path):
    path = _job(tmp_path)
    with pytest.raises(JobError, match=r"has SPEC, a dict, not a function"):   # (it said "has no function SPEC()")
        load_job(path + ":SPEC")
    with pytest.raises(JobError, match=r"has no function nothere\(\)"):
        load_job(path + ":nothere")


class _Returns:
    """A worker whose ``grads`` returns the gradient it was given (three values), on the backend
    the JobWorker is given (a class attribute ``backend = "python"`` made every "numpy" case
    of the tests below run the pure-Python path: JobWorker.backend asks the job's worker first)."""
    bucket_len, batch = 3, 4

    def __init__(self, grad):
        self.grad = grad

    def grads(self, offset, samples):
        return 0.5, self.grad


def _gradient_of(grad, backend="python"):
    from tabcohort.jobs.worker import JobWorker
    return JobWorker(_Returns(grad), backend=backend, spec={}, model="m", batch=4).grads_sync(0)[1]


def _js_typed_array(name):
    import js
    return getattr(js, name).new(3)


_INTEGER_GRADIENTS = [
    (lambda: array("i", [1, 2, 3]), "typecode 'i'"),
    (lambda: array("B", [1, 2, 3]), "typecode 'B'"),
    (lambda: np.zeros(3, dtype=np.int32), "dtype int32"),
    (lambda: np.zeros(3, dtype=bool), "dtype bool"),
    (lambda: memoryview(array("i", [1, 2, 3])), "memoryview format 'i'"),
    (lambda: memoryview(b"\x00\x01\x02"), "memoryview format 'B'"),
    (lambda: memoryview(b"\x00" * 6).cast("h"), "memoryview format 'h'"),
    (lambda: bytearray(b"\x00\x01\x02"), "bytearray format 'B'"),
    (lambda: _js_typed_array("Int32Array"), "JS Int32Array"),
    (lambda: _js_typed_array("Uint8Array"), "JS Uint8Array"),
    # (a new-user trial: ``[int(v) for v in g]`` trained 300 steps on zeros, and simulate said
    # "bit-identical: yes" of the untrained parameters)
    (lambda: [0, 1, 0], "list of Python ints"),
    (lambda: (0, True, 0), "tuple of Python ints"),
]


@pytest.mark.parametrize("make,what", _INTEGER_GRADIENTS, ids=[what for _, what in _INTEGER_GRADIENTS])
def test_a_gradient_of_integers_is_refused_naming_what_it_is(make, what):
    """docs/PROTOCOL.md "Worker contract": a gradient whose elements say they are integers is
    refused, whatever carries it (it would train on zeros or garbage)."""
    if "dtype" in what and np is None:
        pytest.skip("needs numpy: a numpy dtype")
    if what.startswith("JS ") and sys.platform != "emscripten":
        pytest.skip("JS typed arrays exist in Pyodide only")
    for backend in ("python", "numpy") if np is not None else ("python",):
        with pytest.raises(JobError, match=rf"grads\(\) returned a gradient of {what}: it must be floating point "
                                           rf"\(float32\) \(.*test_jobs\.py:\d+, where grads is defined\)"):
            _gradient_of(make(), backend)


def test_a_gradient_of_floats_is_taken_whatever_carries_it():
    """docs/PROTOCOL.md "Worker contract": float formats pass in any byte order (a ctypes array
    exports '<f'), as float32 values."""
    cases = [array("f", [1, 2, 3]), array("d", [1, 2, 3]), memoryview(array("f", [1, 2, 3])),
             memoryview(array("d", [1, 2, 3])), [1.0, 2.0, 3.0],
             [1, 2.0, 3]]   # (ints beside floats: ``[0] * n`` with the entries a batch touched)
    try:
        import ctypes
    except ImportError:
        pass
    else:
        for t in (ctypes.c_float, ctypes.c_double):
            c = (t * 3)(1, 2, 3)
            assert memoryview(c).format in ("<f", "<d", ">f", ">d")   # (not native '@': '<f' on x86)
            cases.append(c)
            cases.append(memoryview(c))
    if np is not None:
        cases += [np.array([1, 2, 3], dtype=np.float32), np.array([1, 2, 3], dtype=np.float16)]
    if sys.platform == "emscripten":
        for name in ("Float32Array", "Float64Array"):
            t = _js_typed_array(name)
            t[0], t[1], t[2] = 1, 2, 3
            cases.append(t)
    for backend in ("python", "numpy") if np is not None else ("python",):
        for g in cases:
            assert list(_gradient_of(g, backend)) == [1.0, 2.0, 3.0], (backend, g)
        # an exact zero gradient of a pure-Python job: ``[0] * n`` no sample touched (a reviewer's
        # find: refused, three in a row stopped a converged perceptron's rank)
        assert list(_gradient_of([0, 0, 0], backend)) == [0.0, 0.0, 0.0]


_NOT_ONE_VECTOR = [
    (lambda: [[1.0], [2.0], [3.0]], "a list of one-element lists"),
    (lambda: [np.array([x], dtype=np.float32) for x in (1.0, 2.0, 3.0)], "a list of one-element arrays"),
    (lambda: ((__import__("ctypes").c_float * 1) * 3)(), "a 2-D ctypes array"),
]


@pytest.mark.needs_numpy
@pytest.mark.parametrize("make,what", _NOT_ONE_VECTOR, ids=[what for _, what in _NOT_ONE_VECTOR])
def test_a_gradient_that_is_not_one_flat_vector_is_refused_on_every_backend(make, what):
    """docs/PROTOCOL.md "Worker contract": one flat vector. A nested sequence has no ``shape``
    for the shape check to read; on numpy it became a (3, 1) array whose len() is bucket_len, so
    it passed as a gradient, and a leader under the trimmed mean faulted every round
    (np.stack of its own (3, 1) bucket with its peers' (3,) ones)."""
    for backend in ("python", "numpy"):
        with pytest.raises(JobError, match=r"grads\(\) returned a gradient (of shape \(3, 1\): it must be one flat "
                                           r"vector|that is not a sequence of numbers)"):
            _gradient_of(make(), backend)


@pytest.mark.needs_numpy
@pytest.mark.parametrize("dtype", ["complex64", "datetime64[s]", "timedelta64[s]", "U3"])
def test_a_numpy_gradient_of_a_dtype_that_is_not_floating_point_is_refused(dtype):
    """PROTOCOL.md "Worker contract": floating point is a numpy dtype of kind ``f``. A complex
    gradient lost its imaginary part with only numpy's ComplexWarning, and a datetime, timedelta
    or string one was converted to numbers on the numpy path while the pure-Python path refused it."""
    g = np.array(["1", "2", "3"]).astype(dtype) if dtype == "U3" else np.array([1, 2, 3]).astype(dtype)
    for backend in ("python", "numpy"):
        with pytest.raises(JobError, match=r"grads\(\) returned a gradient of dtype " + re.escape(str(g.dtype))
                           + ": it must be floating point"):
            _gradient_of(g, backend)


def test_a_gradient_whose_buffer_cannot_be_read_is_a_job_error():
    """A released memoryview (or, from Python 3.12, an object whose ``__buffer__`` raises) is a
    JobError like any other gradient that is not a sequence of numbers, not a ValueError or a
    BufferError out of the worker contract's own check."""
    m = memoryview(array("f", [1.0, 2.0, 3.0]))
    m.release()

    class Unreadable:
        def __buffer__(self, flags):
            raise BufferError("no buffer today")

        def __len__(self):
            return 3

        def __getitem__(self, i):
            raise BufferError("nor items")

    for backend in ("python", "numpy") if np is not None else ("python",):
        for g in (m, Unreadable()):
            with pytest.raises(JobError, match=r"grads\(\) returned a gradient that is not a sequence of numbers"):
                _gradient_of(g, backend)


@pytest.mark.skipif(np is None, reason="needs numpy: the server checks a job's pure-Python path apart only where numpy imports")
def test_serve_announces_a_job_whose_python_path_imports_numpy_as_numpy_only(tmp_path, caplog):
    """README "Write your own job": a job without ``BACKENDS`` that imports numpy at its top level
    passed serve's check of its pure-Python path (numpy imports in the server's process), was
    announced with backends numpy, python, and failed in every tab without numpy. Checked where
    numpy cannot be imported, it is served on numpy only with one warning saying what to
    declare; a job that merely tries numpy keeps its python path."""
    from tabcohort_server.assets import RoomAssets
    from tabcohort_server.config import JobConfig, ServerLimits
    from tabcohort_server.rooms import Room

    def served(src, name):
        caplog.clear()
        a = RoomAssets(Room("r", JobConfig(job=_job(tmp_path, src, name)), ServerLimits()))
        info = __import__("json").loads(a.job_json)["job_info"]
        return info["backends"], info["accepts"], [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    with caplog.at_level("WARNING", logger="tabcohort.server"):
        backends, accepts, warned = served("import numpy as np\n" + JOB, "npjob.py")
        assert backends == ["numpy"] and accepts is None, (backends, accepts)
        assert len(warned) == 1 and "npjob.py" in warned[0] and "needs numpy" in warned[0], warned
        assert 'declare BACKENDS = ("numpy",)' in warned[0] and "No module named 'numpy'" in warned[0], warned
        for src in (JOB, "try:\n    import numpy\nexcept ImportError:\n    numpy = None\n" + JOB):
            assert served(src, "plain.py") == (["numpy", "python"], None, []), src


def test_a_gradient_of_zeros_only_on_the_probe_batch_is_noted(tmp_path):
    # (a placeholder gradient, or one computed and not returned, trained nothing with the loss
    # flat and nothing said: serve now warns at start)
    zeros = JOB.replace('return 0.5, array("f", [1.0, 1.0, float(offset)])', 'return 0.5, array("f", [0.0] * 3)')
    assert zeros != JOB
    notes: list[str] = []
    probe(load_job(_job(tmp_path, zeros, name="zeros.py")), batch=4, seed=0, notes=notes)
    assert len(notes) == 1 and "a gradient of zeros only" in notes[0] and "will not move" in notes[0], notes
    notes.clear()
    probe(load_job(_job(tmp_path)), batch=4, seed=0, notes=notes)
    assert notes == []


def test_a_slow_evaluate_is_noted_at_the_start_up_check_and_by_the_worker(tmp_path, monkeypatch):
    # (a new-user trial: evaluate() of 2 s held the leader's loop past the drop bound, the lead
    # changed hands at every evaluation and the run ended without its final checkpoint, unsaid)
    import tabcohort.jobs.worker as worker
    monkeypatch.setattr(worker, "SLOW_CALL_S", 0.0)      # (every call is "slow": no test sleeps)
    notes: list[str] = []
    w = probe(load_job(_job(tmp_path)), batch=4, seed=0, notes=notes)
    assert len(notes) == 1 and "the job's evaluate() took" in notes[0] and "--eval-every" in notes[0], notes
    assert w.slow_evaluate is not None and w.slow_evaluate > 0
    monkeypatch.setattr(worker, "SLOW_CALL_S", 60.0)
    notes.clear()
    probe(load_job(_job(tmp_path)), batch=4, seed=0, notes=notes)
    assert notes == []
    # the built-in job's user wrote no evaluate() to make faster: told of the load and --eval-every
    # (a new-user trial: a busy machine's 0.8 s was met with "evaluate a subset of the held-out set")
    from tabcohort.jobs import BUILTIN
    monkeypatch.setattr(worker, "SLOW_CALL_S", 0.0)
    probe(load_job(BUILTIN, options={"dataset": "synthetic"}), batch=4, seed=0, notes=notes)
    said = [n for n in notes if "evaluate()" in n]
    assert len(said) == 1 and "built-in job's evaluate()" in said[0] and "is this one busy?" in said[0], notes
    assert "subset" not in said[0] and "serve --eval-every" in said[0], said


@pytest.mark.parametrize("where", ["import", "load_data", "factory"])
def test_a_job_that_ends_the_process_is_a_job_error_naming_it(tmp_path, where):
    # (a job's sys.exit(), or an argparse parser at its import, ended serve with its exit code
    # and no word: a new-user trial)
    src = {"import": "import sys\nsys.exit(3)\n" + JOB,
           "load_data": JOB + "\n\ndef load_data():\n    import sys\n    sys.exit(3)\n",
           "factory": JOB.replace("    return W(batch)", "    raise SystemExit(3)")}[where]
    with pytest.raises(JobError, match=r"SystemExit: 3: a job must not end the process"):
        job = load_job(_job(tmp_path, src, name=f"exits_{where}.py"))
        job.make_worker(batch=4, seed=0)


@pytest.mark.parametrize("bad", ["-5", "0", "2.5", "'100'", "True"])
def test_a_worker_train_len_that_is_no_row_count_is_refused(tmp_path, bad):
    # (train_len = -5 was taken without a word, the state report's epoch dropped: a new-user trial)
    src = JOB.replace("self.batch, self.bucket_len, self.p = batch, 3,", f"self.train_len = {bad}\n        self.batch, self.bucket_len, self.p = batch, 3,")
    assert src != JOB
    with pytest.raises(JobError, match=r"train_len must be the number of training rows"):
        load_job(_job(tmp_path, src, name="trainlen.py")).make_worker(batch=4, seed=0)
    ok = JOB.replace("self.batch, self.bucket_len, self.p = batch, 3,", "self.train_len = 100\n        self.batch, self.bucket_len, self.p = batch, 3,")
    assert load_job(_job(tmp_path, ok, name="trainlen_ok.py")).make_worker(batch=4, seed=0).train_len == 100
