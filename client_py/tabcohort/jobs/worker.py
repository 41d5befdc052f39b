"""The worker contract around a job's worker (docs/PROTOCOL.md, "Worker contract";
docs/INTERFACES.md, "Jobs")."""

from __future__ import annotations

import asyncio
import inspect
import math
import struct
import time
from array import array
from typing import Any

from .._compat import np
from ..errors import ConfigError
from .source import JobError

def _vector(backend: str, v: Any) -> Any:
    if backend == "numpy" and np is not None:
        return np.asarray(v, dtype=np.float32)
    if isinstance(v, memoryview) and v.format.lstrip("@") not in ("f", "d"):
        # (a memoryview iterates only native formats: '<f' of a ctypes array raised
        # NotImplementedError)
        return array("f", [x for (x,) in struct.iter_unpack(v.format, v.tobytes())])
    return v if isinstance(v, array) and v.typecode == "f" else array("f", v)


def _not_floating(g: Any) -> str | None:
    """What a gradient's elements are when they say so and are not floating point (``dtype
    int32``, ``typecode 'i'``, ``memoryview format 'B'``, ``JS Int32Array``, a list of Python
    ints only, not all 0), else None (floats, or a gradient that does not say: its values are converted one
    by one).

    Floating point is a numpy dtype of kind ``f``, an ``array`` of typecode ``f`` or ``d``, a
    buffer of struct format ``e``, ``f`` or ``d`` in any byte order (``'<f'``, ``'=d'``), or a
    JS ``Float16Array``, ``Float32Array`` or ``Float64Array`` (docs/PROTOCOL.md, "Worker
    contract")."""
    kind = getattr(getattr(g, "dtype", None), "kind", None)
    if kind is not None:
        # (an object array holds Python values: converted one by one, as a list's are; any other
        # kind but ``f`` is not floating point: a complex one lost its imaginary part, and a
        # datetime, timedelta or string one became numbers on numpy only)
        return None if kind in ("f", "O") else f"dtype {g.dtype}"
    if isinstance(g, array):
        return None if g.typecode in ("f", "d") else f"typecode {g.typecode!r}"
    if type(g).__module__ == "pyodide.ffi":      # a JS value, in a tab
        from pyodide.ffi import JsTypedArray
        if not isinstance(g, JsTypedArray):
            return None
        name = str(g.constructor.name)
        return None if name.startswith("Float") else f"JS {name}"
    if isinstance(g, (list, tuple)):
        # Python numbers, converted one by one. A list of ints only with one that is not 0
        # (``[int(x) for x in g]``: gradients truncated) is refused; one of zeros only is an
        # exact zero gradient (``[0] * n`` that no sample touched: a converged perceptron, a
        # tab's all-zero JS Array, whose integral numbers Pyodide makes ints) and passes, as does
        # ``[0] * n`` filled in part with floats (the scan stops at the first float)
        if g and not any(type(x) is float or isinstance(x, float) for x in g) \
                and all(type(x) is int or type(x) is bool for x in g) and any(g):
            return f"{type(g).__name__} of Python ints"
        return None
    try:
        with memoryview(g) as m:
            fmt = m.format
    except (TypeError, ValueError, BufferError):  # (no buffer; or an unreadable one: a released
        return None                              # memoryview, a __buffer__ that raises)
    return None if fmt.lstrip("@=<>!") in ("e", "f", "d") else f"{type(g).__name__} format {fmt!r}"


#: seconds a synchronous ``grads`` call may hold a rank's event loop before the rank says so:
#: the loop also carries the beats and rounds (README "Write your own job": keep one call under
#: about half a second); a job whose bucket took 2 s never committed a step, with no word why
SLOW_CALL_S = 0.5


def slow_call_note(slow: tuple[float, int], *, flag: str = "--batch", ranks: int = 1) -> str:
    """What a ``grads`` call of ``slow = (seconds, samples)`` means, and the setting that would
    keep one call near a quarter of a second: ``flag`` (a rank's ``--batch``, or ``simulate``'s
    ``--global-batch`` over ``ranks`` ranks), or none when one sample is already too slow."""
    took_s, samples = slow
    per_call = int(samples * 0.25 / took_s)
    what = (f"make grads async and await asyncio.sleep(0) between slices (one sample takes "
            f"{took_s / max(1, samples):.2f} s)" if per_call < 1 else
            f"cap it with {flag} {per_call * ranks} (if its time grows with the samples), or make grads async "
            f"and await asyncio.sleep(0) between slices")
    return (f"the job's grads() held the event loop for {took_s:.1f} s computing {samples} samples, call after call "
            f"(beats and rounds wait meanwhile; keep one call under about {SLOW_CALL_S:g} s): {what} "
            f"(README \"Write your own job\")")


def is_builtin(worker: Any) -> bool:
    """Whether ``worker`` (a :class:`JobWorker`, or what it wraps) runs tabcohort's own model
    code (the built-in job), not a user's."""
    return type(getattr(worker, "inner", worker)).__module__.startswith("tabcohort.")


def slow_evaluate_note(took_s: float, *, builtin: bool = False) -> str:
    """What an ``evaluate()`` call of ``took_s`` seconds means: the leader runs it on its event
    loop every ``eval_every`` steps and for each checkpoint, and the beats wait meanwhile; one
    past the cohort's drop bound (docs/PROTOCOL.md "Timing": 1.6 s by default) made the others
    take the lead from it again and again, and a run ended without its final checkpoint, its
    ranks on different models (a new-user trial: a 2 s evaluate()). ``builtin``: the built-in
    job's, whose code the user never wrote: its advice is the machine's load and ``--eval-every``."""
    if builtin:
        return (f"the built-in job's evaluate() took {took_s:.1f} s (it takes milliseconds on an idle machine: "
                f"is this one busy?): the leader runs it on its event loop every --eval-every steps and for "
                f"each checkpoint, and beats wait meanwhile; past the cohort's drop bound, 1.6 s by default, the "
                f"others take the lead from it: evaluate less often (serve --eval-every)")
    return (f"the job's evaluate() took {took_s:.1f} s: the leader runs it on its event loop every --eval-every "
            f"steps and for each checkpoint, and beats wait meanwhile (keep it under about {SLOW_CALL_S:g} s; "
            f"past the cohort's drop bound, 1.6 s by default, the others take the lead from it, again and again): "
            f"evaluate a subset of the held-out set, or evaluate less often (--eval-every) "
            f"(README \"Write your own job\")")


def global_batch_note(global_batch: int, train_len: int | None) -> str | None:
    """A warning when a round covers more samples than the training set has, or None.

    Every round then covers the set more than once (docs/PROTOCOL.md "Shares": consecutive
    windows wrap), so the gradient is the full-batch one computed several times over; and the
    leader's bucket, noise-free, is the reference of the robust aggregation's clip rule
    (docs/PROTOCOL.md "Untrusted ranks"), against which honest small shares look noisy: they
    are clipped and may be quarantined (a new-user trial: global batch 100000 over 1,600 samples).
    """
    if not train_len or global_batch <= train_len:
        return None
    return (f"the global batch {global_batch} is larger than the job's training set ({train_len} samples): every "
            f"round covers it {global_batch / train_len:.1f} times over (the gradient of a global batch of {train_len}, "
            f"computed that many times), and small shares' buckets look noisy beside the leader's full-batch one: the "
            f"robust aggregation may clip or quarantine honest ranks (README \"Untrusted ranks\"); a global batch "
            f"of at most {train_len} avoids both")


def _describe(x: Any) -> str:
    """A short description of a value a job returned, for an error message."""
    r = repr(x)
    return f"{type(x).__name__} {r[:60] + '...' if len(r) > 60 else r}"


class JobWorker:
    """The worker contract around a job's worker: ``grads`` awaitable (a sync one runs as is),
    ``grads_sync``, ``apply`` (the job's, else ``float32(params - lr * avg)``), ``set_params``
    given the backend's vector type, ``evaluate_loss`` (NaN when the job has none), ``spec()``
    (the job's spec: into the job hash), ``model`` and ``backend`` names.
    """

    def __init__(self, inner: Any, *, backend: str, spec: dict, model: str, batch: int,
                 make_scratch: Any = None) -> None:
        self.inner = inner
        self._make_scratch = make_scratch     # another worker of the same job (local steps)
        self._scratch: Any = None
        self._backend = backend
        self._note: str | None = None
        self.model = str(getattr(inner, "model", None) or model)
        self.batch = int(getattr(inner, "batch", batch))
        self.bucket_len = int(inner.bucket_len)
        self._spec = spec
        #: absolute paths of the job's files (set by the job loader), or None
        self.job_files: set[str] | None = None
        self._async = inspect.iscoroutinefunction(getattr(inner, "grads", None))
        # a worker with its own grads_sync, or its own local steps (both local_grads, awaitable,
        # and local_grads_sync: tabcohort's MLP workers) is used for them as is
        self._own_sync = getattr(inner, "grads_sync", None) if self._async else None
        own_local, own_local_sync = getattr(inner, "local_grads", None), getattr(inner, "local_grads_sync", None)
        both = inspect.iscoroutinefunction(own_local) and callable(own_local_sync)
        self._own_local = own_local if both else None
        self._own_local_sync = own_local_sync if both else None
        #: training samples (the state report's epoch = samples assigned / this), or None
        self.train_len: int | None = None
        self._slow: tuple[float, int] | None = None     # (seconds, samples) of the slow calls
        self._slow_in_a_row = 0
        #: seconds of the longest evaluate() call over SLOW_CALL_S, or None (slow_evaluate_note)
        self.slow_evaluate: float | None = None

    @property
    def backend(self) -> str:
        """The backend the worker computes on (the job's worker may fall back at run time)."""
        return str(getattr(self.inner, "backend", None) or self._backend)

    @property
    def backend_note(self) -> str | None:
        """Why the worker is not on the backend asked for, or None (the job worker's own note,
        else one the runtime set)."""
        return getattr(self.inner, "backend_note", None) or self._note

    @backend_note.setter
    def backend_note(self, note: str | None) -> None:
        self._note = note

    @property
    def adapter(self) -> str | None:
        """The GPU adapter's name of a worker on WebGPU, or None."""
        return getattr(self.inner, "adapter", None)

    def spec(self) -> dict:
        return dict(self._spec)

    async def local_grads(self, offset: int, samples: int, steps: int, optimizer: str = "sgd",
                          lr: float = 0.1, should_stop: Any = None) -> tuple[float, Any] | None:
        """H inner steps on a scratch worker of the same job from this worker's parameters
        (docs/PROTOCOL.md, "Local steps and optimizer state"): inner step ``i`` covers samples
        ``offset + i * samples ..`` (mod 2^32); returns the mean inner loss and the
        pseudo-gradient (float32, shape (bucket_len,)), or None when ``should_stop()`` became
        true between steps. The loop yields to the event loop between steps.

        Raises:
            LocalProtocolError: the job cannot build a second worker (no factory known).
        """
        if self._own_local is not None:
            got = await self._own_local(offset, samples, steps, optimizer, lr, should_stop=should_stop)
            return None if got is None else self._loss_and_gradient(got)
        if self._scratch is None:
            s = self._new_scratch()
            self._scratch = await s if inspect.isawaitable(s) else s
        steps_ = self._local_steps(offset, samples, steps, optimizer, lr)
        try:
            req = next(steps_)
            while True:
                g = await self._scratch.grads(*req)
                req = steps_.send(g)
                await asyncio.sleep(0)   # (between inner steps)
                if should_stop is not None and should_stop():
                    steps_.close()
                    return None
        except StopIteration as done:
            return done.value

    def local_grads_sync(self, offset: int, samples: int, steps: int, optimizer: str = "sgd",
                         lr: float = 0.1) -> tuple[float, Any]:
        """:meth:`local_grads` without yielding to the event loop (the same result; the
        simulator's virtual-time ranks use it)."""
        if self._own_local_sync is not None:
            return self._loss_and_gradient(self._own_local_sync(offset, samples, steps, optimizer, lr))
        if self._scratch is None:
            s = self._new_scratch()
            if inspect.isawaitable(s):
                getattr(s, "close", lambda: None)()
                from ..errors import LocalProtocolError
                raise LocalProtocolError("the job's factory is asynchronous: its local steps run awaited "
                                         "(local_grads), not local_grads_sync")
            self._scratch = s
        steps_ = self._local_steps(offset, samples, steps, optimizer, lr)
        try:
            g = next(steps_)
            while True:
                g = steps_.send(self._scratch.grads_sync(*g))
        except StopIteration as done:
            return done.value

    def _local_steps(self, offset: int, samples: int, steps: int, optimizer: str, lr: float) -> Any:
        """The inner loop as a generator: it yields ``(offset, samples)`` of the next inner
        gradient and is sent ``(loss, grad)`` back; it returns ``(mean loss, pseudo-gradient)``."""
        from ..model.local import InnerOptimizer, pseudo_gradient

        scratch, p0 = self._scratch, self.params()
        opt = InnerOptimizer(optimizer, lr, len(p0))
        scratch.set_params(p0)
        p, total = scratch.params(), 0.0
        for i in range(int(steps)):
            loss, g = yield ((offset + i * samples) % (1 << 32), samples)
            total += float(loss)
            p = opt.step(p, g)
            scratch.set_params(p)
        return total / int(steps), pseudo_gradient(p0, scratch.params())

    def _new_scratch(self) -> Any:
        """Another worker of the same job (a JobWorker, or an awaitable of one for a job whose
        factory is asynchronous).

        Raises:
            LocalProtocolError: no factory is known.
        """
        if self._make_scratch is None:
            from ..errors import LocalProtocolError
            raise LocalProtocolError("local steps need a second worker of the job (no factory)")
        return self._make_scratch()

    async def grads(self, offset: int, samples: int | None = None) -> tuple[float, Any]:
        n = self.batch if samples is None else int(samples)
        if self._async:
            r = await self.inner.grads(offset, n)
        else:
            await asyncio.sleep(0)
            t0 = time.perf_counter()
            r = self.inner.grads(offset, n)
            self._timed(time.perf_counter() - t0, n)
        return self._loss_and_gradient(r, n)

    def _timed(self, took_s: float, samples: int) -> None:
        # two slow calls in a row, not one: a first call's warm-up (a JIT, a lazy import) is no
        # habit (a review: one slow first call gave advice to a rank at 1.8M samples/s)
        self._slow_in_a_row = self._slow_in_a_row + 1 if took_s > SLOW_CALL_S else 0
        if self._slow_in_a_row >= 2 and self._slow is None:
            self._slow = (took_s, samples)

    @property
    def slow_call(self) -> tuple[float, int] | None:
        """``(seconds, samples)`` of a synchronous ``grads`` call that held the event loop over
        :data:`SLOW_CALL_S`, once two did in a row (this worker's, or its local steps' scratch
        worker's), else None; :func:`slow_call_note` says what it means."""
        scratch = getattr(self._scratch, "slow_call", None)
        return self._slow or scratch

    def grads_sync(self, offset: int, samples: int | None = None) -> tuple[float, Any]:
        n = self.batch if samples is None else int(samples)
        if self._own_sync is not None:
            r = self._own_sync(offset, n)
        else:
            r = asyncio.run(self.inner.grads(offset, n)) if self._async else self.inner.grads(offset, n)
        return self._loss_and_gradient(r, n)

    def _loss_and_gradient(self, r: Any, samples: int | None = None) -> tuple[float, Any]:
        """``(loss, gradient)`` of what the job's ``grads`` returned, or a JobError saying what
        the worker contract wants (docs/PROTOCOL.md, "Worker contract")."""
        try:
            loss, g = r        # (a tuple, a list, a page's JS array of two)
        except (TypeError, ValueError):
            raise JobError(f"grads() must return a pair (loss, gradient), got {_describe(r)}", self.model) from None
        if isinstance(loss, (str, bytes)) or not isinstance(loss, (int, float)) and not hasattr(loss, "__float__"):
            raise JobError(f"grads() must return a number as its loss, got {_describe(loss)}", self.model)
        if isinstance(g, (str, bytes)):
            raise JobError(f"grads() returned a gradient that is not a sequence of numbers: got {_describe(g)}"
                           f"{self._grads_defined()}", self.model)
        try:
            shape = getattr(g, "shape", None)
        except ValueError:   # (a released memoryview: "not a sequence of numbers" below says so)
            shape = None
        if isinstance(shape, tuple) and len(shape) > 1:
            # (a (1, N) array was reported as "1 gradient values")
            raise JobError(f"grads() returned a gradient of shape {shape}: it must be one flat vector of "
                           f"bucket_len = {self.bucket_len} values (reshape(-1)){self._grads_defined()}", self.model)
        what = _not_floating(g)
        if what is not None:
            # (an integer gradient, e.g. ``.astype(np.int32)`` of values below 1, is all zeros:
            # it passed every check and the model never trained: a new-user trial; a memoryview
            # of one, or a tab's JS Int32Array, passed this check too)
            raise JobError(f"grads() returned a gradient of {what}: it must be floating point (float32)"
                           f"{self._grads_defined()}", self.model)
        try:
            v = _vector(self.backend, g)
            n = len(v)
        except (TypeError, ValueError, BufferError) as e:
            # TypeError: a bare number, a 0-d array, array("f") of non-numbers; ValueError: numpy's
            # "could not convert string to float", which pointed into tabcohort
            if isinstance(e, TypeError) and not (hasattr(g, "__len__") or hasattr(g, "__iter__")):
                raise JobError(f"grads() must return a vector as its gradient, got {_describe(g)}", self.model) from None
            raise JobError(f"grads() returned a gradient that is not a sequence of numbers ({e}): got "
                           f"{_describe(g)}{self._grads_defined()}", self.model) from None
        ndim = getattr(v, "ndim", 1)
        if ndim != 1:
            # a nested sequence has no shape for the check above: on numpy [[x], [y], ...] became
            # a (bucket_len, 1) array that passed the length check, and a leader under the
            # trimmed mean faulted every round (its own bucket stacked with its peers' flat ones)
            raise JobError(f"grads() returned a gradient of shape {tuple(v.shape)}: it must be one flat vector of "
                           f"bucket_len = {self.bucket_len} values (reshape(-1)){self._grads_defined()}", self.model)
        if n != self.bucket_len:
            # checked at every bucket, not only at the start-up probe: a job whose gradient
            # changed length later was taken for a diverged run (simulate) or stalled a room
            # (it ended "(a share of 8 samples)", which read as the cause, and named no line)
            raise JobError(f"grads() returned {n} gradient values, but the worker's bucket_len is "
                           f"{self.bucket_len} (one per parameter, whatever the samples){self._grads_defined()}",
                           self.model)
        try:
            return float(loss), v
        except (TypeError, ValueError):   # (an array of losses: the error pointed into tabcohort)
            raise JobError(f"grads() must return a number as its loss (the batch's mean), got "
                           f"{_describe(loss)}", self.model) from None

    def _grads_defined(self) -> str:
        """`` (FILE:LINE, where grads is defined)`` of the job's worker, or "" (a bad return has
        no traceback into the job: this says where to look)."""
        code = getattr(getattr(self.inner, "grads", None), "__code__", None)
        return f" ({code.co_filename}:{code.co_firstlineno}, where grads is defined)" if code is not None else ""

    def params(self) -> Any:
        return _vector(self.backend, self.inner.params())

    def set_params(self, vec: Any) -> None:
        self.inner.set_params(_vector(self.backend, vec))

    def apply(self, avg: Any, lr: float) -> None:
        if hasattr(self.inner, "apply"):
            self.inner.apply(_vector(self.backend, avg), lr)
            return
        p = self.params()
        if self.backend == "numpy" and np is not None:
            new = (p.astype(np.float64) - float(lr) * np.asarray(avg, dtype=np.float64)).astype(np.float32)
        else:
            new = array("f", [a - lr * b for a, b in zip(p, avg)])
        self.inner.set_params(new)

    def evaluate(self) -> float:
        t0 = time.perf_counter()
        acc = self.inner.evaluate()
        took_s = time.perf_counter() - t0
        if took_s > SLOW_CALL_S and took_s > (self.slow_evaluate or 0.0):
            self.slow_evaluate = took_s
        try:
            return float(acc)
        except (TypeError, ValueError):   # (None, an array: the error pointed into tabcohort)
            raise JobError(f"evaluate() must return a number (held-out accuracy in [0, 1]), got "
                           f"{_describe(acc)}", self.model) from None

    def evaluate_loss(self) -> float:
        f = getattr(self.inner, "evaluate_loss", None)
        return float(f()) if f is not None else math.nan


#: a classifier whose training loss is this many times a uniform guess's (ln of the classes) has
#: diverged, although every gradient stayed finite (README "Divergence")
LOSS_BLOWUP = 10.0


def loss_ceiling(worker: Any) -> float | None:
    """``LOSS_BLOWUP * ln(classes)`` for a softmax cross-entropy model (the job's model ``spec()``
    has ``"loss": "softmax_xent"`` and ``layers``, the last being the classes), else None.

    Args:
        worker: a :class:`JobWorker` (its ``inner`` model is asked) or a model with ``spec()``.
    """
    inner = getattr(worker, "inner", worker)
    spec = inner.spec() if callable(getattr(inner, "spec", None)) else None
    layers = spec.get("layers") if isinstance(spec, dict) else None
    if not layers or spec.get("loss") != "softmax_xent" or isinstance(layers[-1], bool) \
            or not isinstance(layers[-1], int) or layers[-1] < 2:
        return None
    return LOSS_BLOWUP * math.log(layers[-1])


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``numpy`` when importable, else ``python``.

    Raises:
        ConfigError: an unknown backend, or ``numpy`` without numpy.
    """
    if backend not in ("auto", "numpy", "python"):
        raise ConfigError("backend", backend, "expected one of auto, numpy, python")
    if backend == "auto":
        return "numpy" if np is not None else "python"
    if backend == "numpy" and np is None:
        raise ConfigError("backend", backend, "numpy is not importable in this process")
    return backend
