"""Jobs: a user's model and data, defined once at the server (README "Write your own job").

A job is a Python module (one ``.py`` file, or a package directory) that defines:

- ``make_worker(data, *, batch, seed, backend)`` (the *factory*; another name with
  ``PATH:NAME``): returns a worker following the worker contract (docs/PROTOCOL.md, "Worker
  contract"; docs/INTERFACES.md, "Worker"): ``bucket_len``, ``batch``, ``grads(offset, samples)``
  (sync or async) -> ``(mean loss, mean gradient of bucket_len float32)``, ``params()``,
  ``set_params(vec)``, ``evaluate()`` (held-out accuracy in [0, 1]); optional ``apply(avg, lr)``
  (default plain SGD in float32), ``evaluate_loss()``, ``model``. ``data`` is a :class:`JobData`
  (name -> :class:`~tabcohort.jobs.arrays.NdArray`); ``backend`` is ``"numpy"`` or ``"python"``
  (vectors are numpy float32 arrays or ``array('f')``).
- optionally ``load_data()`` (run by the server only, once at start): a dict name -> numpy
  array or ``NdArray``; it is served to every rank as one ``.npz``, whose sha256 is the data hash.
- optionally ``DATA_SHA256`` (the data hash ``load_data()`` must give) and ``SPEC`` (a
  JSON-ready dict: model name and hyperparameters; into the job hash).
- optionally ``OPTIONS``: a dict option name -> JSON-ready default. A job with options gets the
  room's values (defaults overridden by the server's) as ``load_data(options)`` and the
  factory's ``options=`` keyword; they go into the spec (``spec["options"]``), so the job hash.
- optionally ``BACKENDS``: the backend names the factory accepts as given (``"auto"`` among
  them: the factory chooses); without it ``backend`` is resolved to ``numpy`` or ``python``
  first. A factory may return an awaitable of the worker (:meth:`LoadedJob.make_worker_async`).

The built-in job (:data:`BUILTIN`, the MLP of :mod:`tabcohort.jobs.builtin_mlp`) is such a module
and ships with tabcohort; a rank runs a served job whose code is byte-identical to a job it
ships from its own copy (:func:`shipped_source`).

The job hash (:func:`tabcohort.protocol.job.module_job_hash`) covers the code bundle's sha256,
the data hash, the spec, the factory name and the bucket length, so ranks running different code
or data never mix. :func:`load_job` (server, and ``tabcohort rank --job PATH``),
:func:`load_bundle` (code fetched from a server) and :func:`probe` (the checks before any rank
joins) raise :class:`JobError` naming what is wrong.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import numbers
import operator
import os
import sys
from typing import Any, Callable

from .._compat import np
from ..errors import ConfigError
from ..vec import all_finite, to_vector
from .arrays import ArrayFormatError, NdArray, read_npz, write_npz
from .source import (BUNDLE_MANIFEST, DEFAULT_FACTORY, JobError, JobSource, _said, _where, find_source, load_bundle,
                     source_bundle)
from .worker import JobWorker, is_builtin, loss_ceiling, resolve_backend, slow_evaluate_note

__all__ = ["JobError", "JobData", "JobSource", "LoadedJob", "JobWorker", "load_job", "load_bundle",
           "find_source", "source_bundle", "probe", "resolve_backend", "NdArray", "DEFAULT_FACTORY",
           "BUNDLE_MANIFEST", "BUILTIN", "shipped_source", "loss_ceiling"]

#: The built-in job (``tabcohort serve`` without ``--job``): the MLP over a classification dataset.
BUILTIN = "tabcohort.jobs.builtin_mlp"
#: The jobs that ship with tabcohort (README "Trust model for job code": code a rank already has).
SHIPPED = (BUILTIN,)


class JobData(dict):
    """The job's data: array name -> :class:`NdArray`. ``sha256`` is the hash of ``raw``, the
    ``.npz`` bytes served to ranks (empty dict and ``b""`` for a job without ``load_data``)."""

    raw: bytes = b""
    sha256: str = hashlib.sha256(b"").hexdigest()

    @classmethod
    def from_npz(cls, raw: bytes) -> "JobData":
        """Raises:
            JobError: not an ``.npz`` of supported arrays.
        """
        d = cls()
        if raw:
            try:
                arrays, _ = read_npz(raw)
            except ArrayFormatError as e:
                raise JobError(f"the job's data is not a readable .npz: {e}", "data") from None
            d.update(arrays)
        d.raw = raw
        d.sha256 = hashlib.sha256(raw).hexdigest()
        return d


#: the longest job name (``SPEC["name"]``): every rank sends it as its ``model`` in each hello
#: (at most 256 UTF-8 bytes: tabcohort.wire.frame) and report, and the page shows it; a longer
#: one made every hello fail to encode and every report a drop
JOB_NAME_MAX_CHARS = 64


class LoadedJob:
    """An imported job: its source, module, data and spec; :meth:`make_worker` builds workers."""

    def __init__(self, source: JobSource, module: Any, data: JobData, options: dict | None = None) -> None:
        self.source, self.module, self.data = source, module, data
        spec = getattr(module, "SPEC", None)
        if spec is None:
            spec = {}
        if not isinstance(spec, dict):
            raise JobError(f"SPEC must be a dict, got {type(spec).__name__}", source.ref)
        self.options, _ = job_options(source, module, options)
        if self.options is not None:
            if "options" in spec:
                raise JobError("SPEC has a key 'options': that key holds the job's OPTIONS (rename it)", source.ref)
            spec = dict(spec, options=self.options)
        try:
            json.dumps(spec, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise JobError(f"SPEC and OPTIONS must be JSON-ready data ({e})", source.ref) from None
        self.spec = spec
        self.name = str(spec.get("name") or source.module)
        if len(self.name) > JOB_NAME_MAX_CHARS or not self.name.isprintable():
            raise JobError(f"SPEC[\"name\"] (the module's name when SPEC has none) must be at most "
                           f"{JOB_NAME_MAX_CHARS} printable characters, got {len(self.name)}: "
                           f"{self.name[:JOB_NAME_MAX_CHARS]!r}{'...' if len(self.name) > JOB_NAME_MAX_CHARS else ''}",
                           source.ref)
        backends = getattr(module, "BACKENDS", None)
        if backends is not None and (not isinstance(backends, (tuple, list)) or not backends
                                     or not all(isinstance(b, str) for b in backends)):
            raise JobError(f"BACKENDS must be a tuple of backend names, e.g. (\"numpy\", \"python\"), "
                           f"got {backends!r}", source.ref)
        self.backends = tuple(backends) if backends is not None else None

    @property
    def factory(self) -> Callable[..., Any]:
        return getattr(self.module, self.source.factory)

    def _backend(self, backend: str) -> str:
        """The backend name the factory gets: as asked when the job lists it in ``BACKENDS``;
        ``auto`` for a job that does not list it: numpy when importable and listed, else
        python when listed, else the first listed that can run here (numpy only with numpy);
        without ``BACKENDS``, :func:`resolve_backend`.

        Raises:
            ConfigError: a backend the job does not run on (naming the ones it does).
        """
        if self.backends is None:
            return resolve_backend(backend)
        # (numpy listed and not importable: the factory was called anyway and raised "No module
        # named 'numpy'" from the job's own file: a new-user trial's tab)
        def no_numpy() -> ConfigError:
            return ConfigError("backend", backend, f"numpy is not importable here (a tab without Pyodide's numpy "
                               f"package, or a Python without numpy), and the job {self.name!r} runs on "
                               f"{', '.join(self.backends)} (its BACKENDS); " + (
                                   "ask for another of them, or auto" if set(self.backends) - {"numpy", "auto"} else
                                   "a job that lists \"python\" with a pure-Python path runs anywhere"))
        if backend in self.backends:
            # (a job listing "auto" chooses itself: the built-in job falls back as auto would)
            if backend == "numpy" and np is None and "auto" not in self.backends:
                raise no_numpy()
            return backend
        if backend == "auto":
            for b in (("numpy",) if np is not None else ()) + ("python",):
                if b in self.backends:
                    return b
            runnable = [b for b in self.backends if b != "numpy" or np is not None]
            if not runnable:
                raise no_numpy()
            return runnable[0]
        raise ConfigError("backend", backend, f"the job {self.name!r} runs on {', '.join(self.backends)} "
                          "(its BACKENDS)")

    def _call_factory(self, batch: int, seed: int, backend: str) -> Any:
        files = {os.path.abspath(os.path.join(self.source.root, r)) for r in self.source.files}
        kw: dict[str, Any] = dict(batch=int(batch), seed=int(seed), backend=backend)
        if self.options is not None:
            kw["options"] = dict(self.options)
        try:
            return self.factory(self.data, **kw)
        except ConfigError:   # the job names the setting itself (the built-in job: hidden, backend)
            raise
        except (Exception, SystemExit) as e:
            raise JobError(f"the factory {self.source.factory}() raised {type(e).__name__}: {_said(e)} "
                           f"({_where(e, files, self.factory)}){_no_data_hint(e, self.data)}"
                           f"{self.source.missing_file_hint(e)}", self.source.ref) from None

    def make_worker(self, *, batch: int, seed: int, backend: str = "auto") -> JobWorker:
        """The job's worker, wrapped in :class:`JobWorker`.

        An asynchronous factory (``async def``, or one returning an awaitable) is awaited to the
        end here: on an event loop of its own, in a thread of its own when this thread runs one
        (README "Write your own job": a factory may return an awaitable of its worker).

        Raises:
            JobError: the factory raised (with its file and line), or returned no worker.
            ConfigError: ``backend`` is not one the job runs on.
        """
        w = self._build(batch, seed, self._backend(backend))
        if isinstance(w, _Pending):
            if sys.platform == "emscripten":   # (a tab builds with make_worker_async)
                w.close()
                raise JobError(f"the factory {self.source.factory}() is asynchronous, and no event loop "
                               "can be run to its end in this interpreter (Pyodide)", self.source.ref)
            return _run_to_end(w)
        return w

    async def make_worker_async(self, *, batch: int, seed: int, backend: str = "auto") -> JobWorker:
        """:meth:`make_worker` for a factory that may return an awaitable of its worker (a tab's
        WebGPU probe). Raises as :meth:`make_worker`."""
        w = self._build(batch, seed, self._backend(backend))
        return await w if isinstance(w, _Pending) else w

    def _build(self, batch: int, seed: int, b: str) -> "JobWorker | _Pending":
        """A wrapped worker, or a :class:`_Pending` one when the factory is asynchronous (also
        the scratch worker of local steps)."""
        inner = self._call_factory(batch, seed, b)
        if inspect.isawaitable(inner):
            return _Pending(self, inner, lambda w: self._wrap(w, batch, seed, b))
        return self._wrap(inner, batch, seed, b)

    def _wrap(self, inner: Any, batch: int, seed: int, b: str) -> JobWorker:
        for attr in ("bucket_len", "params", "set_params", "grads", "evaluate"):
            if not hasattr(inner, attr):
                raise JobError(f"the worker {self.source.factory}() returned has no {attr!r} "
                               "(docs/PROTOCOL.md, \"Worker contract\")", self.source.ref)
        bl = getattr(inner, "bucket_len")
        if isinstance(bl, bool) or not isinstance(bl, int) or bl < 1:
            raise JobError(f"the worker's bucket_len must be an integer >= 1, got {bl!r}", self.source.ref)
        full = {"job": self.name, "code_sha256": self.source.code_sha256, "spec": self.spec}
        w = JobWorker(inner, backend=b, spec=full, model=self.name, batch=batch,
                      make_scratch=lambda: self._build(batch, seed, b))
        # the job's own files: a compute error names its line in them (runtime.driver.job_frame)
        w.job_files = {os.path.abspath(os.path.join(self.source.root, r)) for r in self.source.files}
        # the state report's epoch: the worker's own train_len, else the rows of the data's
        # training array by README's naming (y_train, x_train)
        n = getattr(inner, "train_len", None)
        if n is not None:   # the worker's own: the number of training rows, or a job error
            try:
                own = None if isinstance(n, bool) else operator.index(n)
            except TypeError:
                own = None
            if own is None or own <= 0:
                # (-5 was taken without a word, and the state report's epoch dropped: a new-user trial)
                raise JobError(f"the worker's train_len must be the number of training rows (an int > 0), got "
                               f"{n!r}", self.source.ref)
            w.train_len = own
            return w
        arr = next((self.data[k] for k in ("y_train", "x_train") if k in self.data), None)
        w.train_len = len(arr) if arr is not None and len(arr) > 0 else None
        return w

    def job_hash(self, worker: JobWorker, train: Any = None) -> str:
        """The job hash (:func:`~tabcohort.protocol.job.module_job_hash`); ``train``: the room's
        ``TrainConfig.spec()`` (None for the default rounds)."""
        from ..protocol.job import module_job_hash
        return module_job_hash(self.source.code_sha256, self.data.sha256, self.spec, self.source.factory,
                               worker.bucket_len, train)


def _run_to_end(pending: "_Pending") -> JobWorker:
    """Await ``pending`` from synchronous code: ``asyncio.run`` here, or in a thread of its own
    while this thread runs an event loop (one cannot be run inside another)."""
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(pending._run())
    import threading

    out: list[Any] = []

    def build() -> None:
        try:
            out.append(asyncio.run(pending._run()))
        except BaseException as e:   # (raised in the caller's thread below)
            out.append(e)
    t = threading.Thread(target=build, name="tabcohort-async-factory", daemon=True)
    t.start()
    t.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


class _Pending:
    """An awaitable of a wrapped worker from an asynchronous factory's awaitable (what it
    raises is said as a factory error); ``close()`` closes the factory's (a worker never built
    leaves no coroutine behind)."""

    def __init__(self, job: LoadedJob, inner: Any, wrap: Callable[[Any], JobWorker]) -> None:
        self.job, self.inner, self.wrap = job, inner, wrap

    def __await__(self) -> Any:
        return self._run().__await__()

    async def _run(self) -> JobWorker:
        src = self.job.source
        try:
            got = await self.inner
        except ConfigError:   # the job names the setting itself
            raise
        except (Exception, SystemExit) as e:
            files = {os.path.abspath(os.path.join(src.root, r)) for r in src.files}
            raise JobError(f"the factory {src.factory}() raised {type(e).__name__}: {_said(e)} ({_where(e, files)})"
                           f"{_no_data_hint(e, self.job.data)}", src.ref) from None
        return self.wrap(got)

    def close(self) -> None:
        getattr(self.inner, "close", lambda: None)()


def _no_data_hint(e: BaseException, data: Any) -> str:
    """Why a factory's ``data[...]`` failed when the job has no data: a KeyError of a job with
    no ``load_data()`` (its factory gets an empty dict) was said as a bare ``KeyError: 'x'``."""
    if isinstance(e, KeyError) and not data:
        return ("; the job has no data: its factory's data is an empty dict (its module defines no "
                "load_data(), or one that returned {}; README \"Write your own job\")")
    return ""


def job_options(source: JobSource, module: Any, given: dict | None) -> tuple[dict | None, dict]:
    """The job's options: its ``OPTIONS`` defaults overridden by ``given`` (None for a job
    without ``OPTIONS``, which then takes none), and its local options: ``LOCAL_OPTIONS``
    defaults overridden by ``given`` (options only ``load_data`` gets, on the server: neither in
    the job hash nor published, e.g. where a data file is read).

    Raises:
        JobError: ``OPTIONS`` or ``LOCAL_OPTIONS`` is not a dict, ``given`` names an option the
            job does not have, or options are given to a job without ``OPTIONS``.
    """
    defaults, local = getattr(module, "OPTIONS", None), getattr(module, "LOCAL_OPTIONS", None) or {}
    given = dict(given or {})
    if not isinstance(local, dict):
        raise JobError(f"LOCAL_OPTIONS must be a dict, got {type(local).__name__}", source.ref)
    both = sorted(set(local) & set(defaults)) if isinstance(defaults, dict) else []
    if both:   # (load_data got the local value, the factory and the job hash the other)
        raise JobError(f"{', '.join(both)} is in both OPTIONS and LOCAL_OPTIONS: a name is one or the other "
                       "(OPTIONS are in the job hash and published, LOCAL_OPTIONS reach only load_data)", source.ref)
    local = {**local, **{k: given.pop(k) for k in list(given) if k in local}}
    if defaults is None:
        if given:
            raise JobError(f"the job takes no options (no OPTIONS), got {', '.join(sorted(given))}", source.ref)
        return None, local
    if not isinstance(defaults, dict):
        raise JobError(f"OPTIONS must be a dict, got {type(defaults).__name__}", source.ref)
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise JobError(f"no such option {', '.join(unknown)} (the job's options: "
                       f"{', '.join(sorted(defaults) + sorted(local))})", source.ref)
    for k, v in sorted(given.items()):
        why = _option_mismatch(defaults[k], v)
        if why:   # (a new-user trial: hidden=32.5 reached the job's own code, which failed there)
            try:
                shown = json.dumps(v)
            except (TypeError, ValueError):   # (a caller of the Python API may pass any object)
                shown = repr(v)
            # (the hint about fractional numbers only where it applies: it ended every type error)
            hint = ("; a job whose option may be fractional says so in its default, e.g. 1.0"
                    if isinstance(defaults[k], int) and not isinstance(defaults[k], bool)
                    and isinstance(v, (int, float)) and not isinstance(v, bool) else "")
            raise ConfigError("--job-option", f"{k}={shown}", f"the job's option {k} {why} (its default: "
                              f"{defaults[k]!r}){hint}")
    return {**defaults, **given}, local


def _option_mismatch(default: Any, value: Any) -> str | None:
    """Why ``value`` (parsed JSON) cannot stand for an option whose default is ``default``, or
    None: a bool for a bool, a whole number for an int, a number for a float, a string for a
    string, a list for a list or tuple (of whole numbers when the default's are); anything for
    a default of another type (None, a dict)."""
    def whole(x: Any) -> bool:
        return isinstance(x, numbers.Integral) and not isinstance(x, bool)
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "is true or false"
    if whole(default):
        return None if whole(value) else "is a whole number"
    if isinstance(default, float):
        return None if whole(value) or isinstance(value, numbers.Real) and not isinstance(value, bool) else "is a number"
    if isinstance(default, str):
        return None if isinstance(value, str) else "is a string (in JSON quotes, e.g. '\"name\"' in a shell)"
    if isinstance(default, (list, tuple)):
        if not isinstance(value, list):
            return "is a list, e.g. [64, 32]"
        if default and all(whole(x) for x in default) and not all(whole(x) for x in value):
            return "is a list of whole numbers"
    return None


def load_job(ref: str, *, with_data: bool = True, options: dict | None = None,
             timeout_s: float | None = None) -> LoadedJob:
    """Find, compile and import the job ``PATH_OR_MODULE[:FACTORY]`` and run its ``load_data()``
    (when ``with_data``; a rank gets the data from the server instead). ``options`` override the
    job's ``OPTIONS`` defaults.

    Args:
        timeout_s: with a number, the import may take that many seconds and ``load_data()``
            :data:`LOAD_DATA_TIMEOUT_S` (:func:`run_bounded`, on the caller's thread: before, a
            module that never finished importing hung ``serve`` and ``simulate`` with nothing
            said). ``None``: unbounded (Pyodide has no threads).

    Raises:
        JobError: see :func:`find_source`, :meth:`JobSource.import_module`, :func:`job_options`;
            ``load_data`` raising or returning something that is not a dict of arrays; the
            data's sha256 differing from the job's ``DATA_SHA256``; the import or
            ``load_data()`` still running at its bound.
    """
    src = find_source(ref)
    mod = run_bounded(src.import_module, timeout_s=timeout_s, doing=["importing the job's module"], ref=src.ref,
                      hint="its top level must define things, not wait or train: move that work into a function",
                      on_main_thread=True)
    data = JobData()
    if with_data:
        opts, local = job_options(src, mod, options)
        data = run_bounded(lambda: job_data(src, mod, None if opts is None else {**opts, **local}),
                           timeout_s=None if timeout_s is None else max(timeout_s, LOAD_DATA_TIMEOUT_S),
                           doing=["load_data()"], ref=src.ref, on_main_thread=True,
                           hint="it must return the job's arrays; a dataset it cannot build in that time "
                                "can be built once and read from a file")
    return LoadedJob(src, mod, data, options)


#: seconds a job's ``load_data()`` may take when :func:`load_job` is bounded (it may build or
#: read a large dataset: longer than the other start-up checks)
LOAD_DATA_TIMEOUT_S = 600.0


class _Overrun(BaseException):
    """Raised by the alarm of :func:`run_bounded`'s main-thread path (a BaseException, so that a
    job's ``except Exception`` and the import's own error wrapping let it through)."""


def run_bounded(fn: Callable[[], Any], *, timeout_s: float | None, doing: list[str], ref: str,
                hint: str = "a job's calls must return; a slow first call can be warmed up in the factory",
                on_main_thread: bool = False) -> Any:
    """``fn()``, waited for at most ``timeout_s`` seconds; ``doing[0]`` names the call in
    progress (``fn`` may update it).

    By default ``fn`` runs on a daemon thread (a call stuck in C code is bounded too). With
    ``on_main_thread`` and the caller on the main thread, it runs right there under a
    ``SIGALRM`` timer (``setitimer``; a timer already armed, e.g. pytest-timeout's, is re-armed
    with what was left of it): a job's module and ``load_data()`` may set per-thread state
    (``numpy.seterr``, a ``decimal`` context) or install signal handlers, which a helper thread
    lost or refused. Either way the wait is interruptible: Ctrl-C raises ``KeyboardInterrupt`` at
    once (a running event loop's SIGINT handler, e.g. ``asyncio.run``'s, only cancels a task,
    which cannot run meanwhile: the first Ctrl-C did nothing), unless SIGINT was ignored.
    ``timeout_s=None``, or no threads (Pyodide): inline, unbounded.

    Raises:
        JobError: ``fn`` still running at the bound, naming ``doing[0]`` (a thread is left
            behind: the caller is expected to exit); whatever ``fn`` raised.
    """
    if timeout_s is None:
        return fn()
    import contextlib
    import signal
    import threading
    import time

    def overrun() -> JobError:
        return JobError(f"the start-up check did not finish within {timeout_s:g} s: {doing[0]} has not "
                        f"returned ({hint})", ref)
    main = threading.current_thread() is threading.main_thread()
    prev_int = signal.getsignal(signal.SIGINT) if main else None
    interruptible = main and prev_int not in (signal.SIG_IGN, None)

    @contextlib.contextmanager
    def ctrl_c_raises() -> Any:
        if interruptible:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            yield
        finally:
            if interruptible:
                signal.signal(signal.SIGINT, prev_int)
    if main and on_main_thread and hasattr(signal, "setitimer"):
        def on_alarm(signum: int, frame: Any) -> None:
            raise _Overrun()
        prev_alarm = signal.signal(signal.SIGALRM, on_alarm)
        t0 = time.monotonic()
        left_s, _ = signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            with ctrl_c_raises():
                return fn()
        except _Overrun:
            raise overrun() from None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, prev_alarm)
            if left_s > 0:
                signal.setitimer(signal.ITIMER_REAL, max(1e-3, left_s - (time.monotonic() - t0)))
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:       # handed to the caller's thread
            out.append(e)
    t = threading.Thread(target=run, name="job-check", daemon=True)
    try:
        t.start()
    except RuntimeError:                 # no threads here (Pyodide): inline, unbounded
        return fn()
    with ctrl_c_raises():
        end = time.monotonic() + timeout_s
        while t.is_alive() and time.monotonic() < end:
            t.join(min(0.25, max(0.0, end - time.monotonic())))
    if not out:
        raise overrun()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def shipped_source(code_sha256: str | None) -> JobSource | None:
    """The job that ships with tabcohort (:data:`SHIPPED`) whose code bundle has sha256
    ``code_sha256``, or None: a rank runs such a served job from its own copy, with no trust
    asked (README "Trust model for job code"), because the hash proves the code is the rank's own."""
    for ref in SHIPPED:
        src = find_source(ref)
        if src.code_sha256 == code_sha256:
            return src
    return None


def job_data(src: JobSource, mod: Any, options: dict | None = None) -> JobData:
    """Run the job's ``load_data()`` (``load_data(options)`` for a job with ``OPTIONS``) and
    pack it (the server's side).

    Raises:
        JobError: it raised, returned no dict of arrays, or its hash is not ``DATA_SHA256``.
    """
    fn = getattr(mod, "load_data", None)
    if fn is None:
        return JobData()
    files = {os.path.abspath(os.path.join(src.root, r)) for r in src.files}
    try:
        arrays = fn() if options is None else fn(dict(options))
    except ConfigError:   # the job names the setting itself (the built-in job: its dataset)
        raise
    except (Exception, SystemExit) as e:
        raise JobError(f"load_data() raised {type(e).__name__}: {_said(e)} ({_where(e, files, fn)})", src.ref) from None
    if not isinstance(arrays, dict):
        raise JobError(f"load_data() must return a dict of identifier -> array, not {type(arrays).__name__}", src.ref)
    bad = [k for k in arrays if not (isinstance(k, str) and k.isidentifier())]
    if bad:
        k = bad[0]
        what = (f"its key {k[:80]!r} is not an identifier (letters, digits and _, not starting with a digit)"
                if isinstance(k, str) else f"its key of type {type(k).__name__} is not a string")
        raise JobError(f"load_data() must return a dict of identifier -> array: {what}", src.ref)
    try:
        raw = write_npz(arrays)
    except ArrayFormatError as e:
        raise JobError(f"load_data(): {e}", src.ref) from None
    data = JobData.from_npz(raw)
    want = getattr(mod, "DATA_SHA256", None)
    if want is not None and want != data.sha256:
        raise JobError(f"data hash mismatch: load_data() gave sha256 {data.sha256}, the job declares "
                       f"DATA_SHA256 = {want!r} (the data changed, or update DATA_SHA256)", src.ref)
    return data


#: samples of the bucket :func:`probe` computes (fewer when the batch is smaller): the checks
#: need a bucket, not the room's whole batch (a server of ``--global-batch 200000`` spent about
#: a minute on one pure-Python bucket before it served anything)
PROBE_SAMPLES = 8


#: seconds the start-up checks may take in all (a job whose grads() never returns must not hang
#: ``serve`` or ``simulate`` before they say anything)
PROBE_TIMEOUT_S = 120.0


#: room for a round frame's other fields (step, term, assignment ...) beside its vectors
ROUND_FRAME_HEADROOM = 1 << 20


def check_round_fits(job: LoadedJob, bucket_len: int, state_len: int = 0) -> None:
    """A round carries the parameters and the optimizer state (``state_len`` values) in one
    frame, at float32 at worst (f16 and bf16 fall back to it): it must fit the frame a receiver
    reassembles (``WireLimits.max_frame_bytes``, 64 MiB) and each vector ``max_vector_len``.
    Before, a larger job passed every check and trained on its leader alone: every follower
    dropped every round (``simulate`` ended "bit-identical: NO" with no reason).

    Raises:
        JobError: naming the size, the bound and the largest model that fits.
    """
    from ..wire.limits import WireLimits

    lim = WireLimits()
    room = lim.max_frame_bytes - ROUND_FRAME_HEADROOM
    need = 4 * (bucket_len + state_len)
    if need <= room and max(bucket_len, state_len) <= lim.max_vector_len:
        return
    per = 2 if state_len else 1
    most = min(room // (4 * per), lim.max_vector_len)
    state = f" and {state_len:,} of optimizer state" if state_len else ""
    raise JobError(f"bucket_len {bucket_len:,}{state}: a round carries {need / 2**20:.1f} MiB at float32, more "
                   f"than a frame may hold ({lim.max_frame_bytes >> 20} MiB, WireLimits.max_frame_bytes), so no "
                   f"follower could receive one; at most {most:,} parameters"
                   + (" with this outer optimizer's state (the sgd outer optimizer carries none)" if state_len else ""),
                   job.source.ref)


def probe(job: LoadedJob, *, batch: int, seed: int, backend: str = "auto",
          worker: JobWorker | None = None, timeout_s: float | None = None,
          notes: list[str] | None = None) -> JobWorker:
    """The checks before any rank joins: build a worker (or take ``worker``), check
    ``bucket_len`` against ``params()``, compute one bucket of ``min(batch, PROBE_SAMPLES)``
    samples at offset 0 (its loss finite, its gradient ``bucket_len`` long and finite), evaluate
    (a number in [0, 1]). Returns the worker.

    Args:
        timeout_s: with a number, the checks run on a daemon thread and a check still running
            after that many seconds fails them (:func:`run_bounded`). ``None``: inline,
            unbounded (Pyodide has no threads).
        notes: given a list, what is suspect but not wrong is appended to it (a gradient of
            zeros only on the probe batch: the parameters would never move; an evaluate() that
            held the event loop over ``worker.SLOW_CALL_S``).

    Raises:
        JobError: naming the check that failed, or the one still running at the timeout.
    """
    doing = ["building the worker"]

    def checks() -> JobWorker:
        with job.source.bundle_only():
            return _probe(job, batch, seed, backend, worker, doing, notes)
    return run_bounded(checks, timeout_s=timeout_s, doing=doing, ref=job.source.ref)


#: the largest relative difference serve accepts between a job's two paths on one batch (the
#: norm of the gradients' difference over the larger gradient's norm; the losses' over the larger
#: loss, at least 1): float32 against the pure-Python path's float64 arithmetic differs by about
#: 1e-6, a float16 numpy path by about 1e-3; a flipped sign or a gradient not divided by the
#: batch by 1 and more
PATHS_REL_TOL = 1e-2


def _relative_difference(a: tuple[float, Any], b: tuple[float, Any]) -> tuple[float, float]:
    """``(loss, gradient)`` relative differences of two ``(loss, g)`` results (see
    :data:`PATHS_REL_TOL`)."""
    ga, gb = [float(v) for v in a[1]], [float(v) for v in b[1]]
    if len(ga) != len(gb):
        return math.inf, math.inf
    norm = max(math.sqrt(sum(v * v for v in ga)), math.sqrt(sum(v * v for v in gb)))
    diff = math.sqrt(sum((u - v) ** 2 for u, v in zip(ga, gb)))
    return abs(a[0] - b[0]) / max(abs(a[0]), abs(b[0]), 1.0), diff / norm if norm > 0 else diff


def compare_paths(job: LoadedJob, numpy_worker: JobWorker, python_worker: JobWorker, *,
                  timeout_s: float | None = None) -> str | None:
    """Both paths of a job computed on the same batch from the same parameters agree: the
    pure-Python worker is given the numpy worker's ``params()``, each computes the bucket of
    ``min(batch, PROBE_SAMPLES)`` samples at offset 0 twice, and their losses and gradients must
    agree within :data:`PATHS_REL_TOL`. Why: a cohort mixes both (tabs without numpy take the
    pure one), so a path that computes something else trains the model wrong with nothing said
    (a new-user trial: a python path with the gradient's sign flipped was served, and a tab on
    it pushed the model the other way). A path whose two results differ as much (a stochastic
    job: dropout, augmentation) cannot be compared this way and is not.

    Returns:
        None when compared and equal; a note saying why the paths were not compared.

    Raises:
        JobError: naming both losses and the gradients' relative difference.
    """
    doing = ["comparing the numpy and pure-Python paths"]

    def check() -> str | None:
        ref = job.source.ref
        # (each call said as the probe says it, path and all: a job whose numpy path kept the
        # numpy array set_params() is given and then did float arithmetic on it raised here
        # with a traceback, where the probe of either path alone had passed)
        p = _job_call(job, doing, "params() (numpy path)", numpy_worker.params)
        # both paths given the parameters as every round gives them (set_params()), so a path
        # that fails only on what it is given there fails here, not at a rank's first round
        _job_call(job, doing, "set_params() (numpy path)", lambda: numpy_worker.set_params(to_vector(p)))
        _job_call(job, doing, "set_params() (pure-Python path)", lambda: python_worker.set_params(to_vector(p)))
        n = max(1, min(numpy_worker.batch, python_worker.batch, PROBE_SAMPLES))
        with job.source.bundle_only():
            np1, np2 = (_job_call(job, doing, "grads(0) (numpy path, where set_params() is given a numpy "
                                              "float32 array)", lambda: numpy_worker.grads_sync(0, n))
                        for _ in range(2))
            py1, py2 = (_job_call(job, doing, "grads(0) (pure-Python path)", lambda: python_worker.grads_sync(0, n))
                        for _ in range(2))
        doing[0] = "comparing the numpy and pure-Python paths"
        if max(_relative_difference(np1, np2) + _relative_difference(py1, py2)) > PATHS_REL_TOL:
            return ("its numpy and pure-Python paths were not compared: a path's two results on the same batch "
                    "differ (a stochastic job); make sure both compute the same")
        rel_loss, rel_g = _relative_difference(np1, py1)
        if not rel_g <= PATHS_REL_TOL or not rel_loss <= PATHS_REL_TOL:
            raise JobError(f"its numpy and pure-Python paths disagree on the same {n} samples and parameters "
                           f"(loss {np1[0]:.6g} and {py1[0]:.6g}; the gradients differ by {rel_g:.3g} of the "
                           f"larger one's norm, at most {PATHS_REL_TOL:g} allowed): a cohort mixes both (tabs "
                           f"without numpy take the pure one), so one of them trains the model wrong. Make them "
                           f"compute the same, or declare BACKENDS = (\"numpy\",)", ref)
        return None
    return run_bounded(check, timeout_s=timeout_s, doing=doing, ref=job.source.ref)


def _job_call(job: LoadedJob, doing: list[str], what: str, f: Callable[[], Any]) -> Any:
    """``f()``, a call into the job named ``what`` (``doing[0]`` while it runs); an exception
    it raises becomes a :class:`JobError` naming the call, the job's file and line."""
    doing[0] = what
    try:
        return f()
    except JobError as e:        # the worker contract broken (a bad return): said as is
        raise JobError(e.reason, job.source.ref) from None
    except (Exception, SystemExit) as e:
        files = {os.path.abspath(os.path.join(job.source.root, r)) for r in job.source.files}
        raise JobError(f"the worker's {what} raised {type(e).__name__}: {_said(e)} ({_where(e, files)})"
                       f"{job.source.missing_file_hint(e)}", job.source.ref) from None


#: a parameter moved by more than this fraction of the largest one's magnitude (at least 1)
#: across a ``grads()`` call was changed by it; less is rounding (a finite-difference job that
#: nudges a weight and puts it back may leave its last bit changed)
MOVED_REL_TOL = 1e-6


def _moved(before: Any, after: Any) -> tuple[int, float, float] | None:
    """The first parameter (index, value before, value after) that ``after`` moved from
    ``before`` by more than :data:`MOVED_REL_TOL` of ``max(1, max |before|)``, or None (also
    when the lengths differ: the probe says that apart)."""
    after = to_vector(after)
    if len(after) != len(before):
        return None
    if np is not None and hasattr(before, "dtype"):   # numpy (to_vector's type where it imports): in C
        b, a = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
        scale = max(1.0, float(np.abs(b).max(initial=0.0)))
        bad = np.flatnonzero(~(np.abs(a - b) <= MOVED_REL_TOL * scale))   # (NaN counts as moved)
        return None if not len(bad) else (int(bad[0]), float(b[bad[0]]), float(a[bad[0]]))
    scale = max(1.0, max((abs(x) for x in before), default=0.0))
    for i, (x, y) in enumerate(zip(before, after)):
        if not abs(y - x) <= MOVED_REL_TOL * scale:
            return i, x, y
    return None


def _all_zero(g: Any) -> bool:
    """Whether every value of the float vector ``g`` (numpy or ``array('f')``) is zero."""
    if hasattr(g, "any") and callable(g.any):
        return not bool(g.any())
    return not any(g)


def _probe(job: LoadedJob, batch: int, seed: int, backend: str, worker: JobWorker | None,
           doing: list[str], notes: list[str] | None = None) -> JobWorker:
    """:func:`probe`'s checks; ``doing[0]`` names the call in progress."""
    w = worker if worker is not None else job.make_worker(batch=batch, seed=seed, backend=backend)
    ref = job.source.ref

    def call(what: str, f: Callable[[], Any]) -> Any:
        return _job_call(job, doing, what, f)

    p = call("params()", w.params)
    if len(p) != w.bucket_len:
        raise JobError(f"bucket_len {w.bucket_len} disagrees with params(), which has {len(p)} values", ref)
    if not all_finite(p):
        raise JobError("the initial params() are not finite", ref)
    before = to_vector(p)          # (a copy: params() may return the worker's own array)
    loss, g = call("grads(0)", lambda: w.grads_sync(0, max(1, min(w.batch, PROBE_SAMPLES))))
    moved = _moved(before, call("params()", w.params))
    if moved is not None:
        # (a training loop's habit: a grads() that also stepped its parameters was told its
        # paths "differ (a stochastic job)", and trained on with the leader a step ahead)
        i, was, now = moved
        raise JobError(f"grads(0) changed the parameters (params()[{i}] was {was:.7g} before it, {now:.7g} after): "
                       f"grads() must leave them alone and return the gradient; the round applies the cohort's "
                       f"mean update (apply() or set_params(); docs/PROTOCOL.md \"Worker contract\")", ref)
    if len(g) != w.bucket_len:
        raise JobError(f"grads(0) on a probe batch returned {len(g)} values, bucket_len is {w.bucket_len}", ref)
    if not math.isfinite(loss) or not all_finite(g):
        raise JobError(f"grads(0) on a probe batch is not finite (loss {loss!r}"
                       f"{'' if all_finite(g) else ', gradient has NaN or infinity'})", ref)
    if notes is not None and len(g) and _all_zero(g):
        # (a placeholder gradient, or one computed and not returned, trained nothing with the
        # loss flat and nothing said; a model at a true stationary point at its start is rare)
        notes.append(f"grads(0) returned a gradient of zeros only on a probe batch of "
                     f"{max(1, min(w.batch, PROBE_SAMPLES))} samples ({w.backend} path): the parameters will not "
                     f"move. Is the gradient computed from params() and returned?")
    acc = call("evaluate()", w.evaluate)
    if notes is not None and w.slow_evaluate is not None:   # (timed by the worker, as at run time)
        notes.append(slow_evaluate_note(w.slow_evaluate, builtin=is_builtin(w)))
    if not 0.0 <= acc <= 1.0:
        raise JobError(f"evaluate() must return held-out accuracy in [0, 1], got {acc!r}", ref)
    # set_params must set them: a worker whose set_params() does nothing passed every check, and
    # its ranks "trained" with the loss never moving (a new-user trial); the probe gives it the
    # parameters with their first value changed and reads them back, then restores them
    if len(p):
        orig = to_vector(p)            # (copies: params() may return the worker's own array)
        p0 = float(orig[0])
        # moved well past the rounding of a job that keeps its weights in float16 or bfloat16
        target = p0 + max(1.0, abs(p0)) * 0.5 if abs(p0) < 1e30 else 0.0
        moved = to_vector(orig)
        moved[0] = target
        call("set_params()", lambda: w.set_params(moved))
        back = call("params()", w.params)
        if len(back) != len(orig) or not abs(float(back[0]) - target) < abs(target - p0) / 2:
            raise JobError("set_params(v) does not set the parameters: params() afterwards is not v (every "
                           "round's parameters reach a rank through set_params)", ref)
        call("set_params()", lambda: w.set_params(orig))
    return w
