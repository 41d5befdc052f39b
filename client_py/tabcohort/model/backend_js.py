"""The MLP on a tab's JavaScript kernels (``web/mlp-kernels.js``): backends ``js`` and ``webgpu``.

Only importable usefully under Pyodide, in the rank's Web Worker, where ``web/rank-worker.js``
has put the kernels module on the worker's global scope (``self.tcKernels``). The Python side
keeps the parameters as ``array('f')`` (the pure-Python backend's vector type) and moves whole
vectors across with one copy each way (``JsBuffer.assign`` / ``assign_to``: a memcpy between
Pyodide's heap and a typed array, no per-element conversion).

- ``js`` (:class:`JsMLPWorker`): forward and backward in plain JavaScript, float64 arithmetic
  rounded to float32 once, as the numpy and pure-Python backends compute (so they agree to
  float32 rounding).
- ``webgpu`` (:class:`GpuMLPWorker`): WGSL compute kernels, parameters and data resident on the
  GPU, one queue submission and one readback per bucket, float32 arithmetic. ``apply`` and the
  held-out evaluation run on the js kernels (the leader's update is then bit-identical to every
  other backend's). A kernel error, a lost device or a readback that never comes makes it fall
  back to ``js`` for good; :attr:`MLPWorker.backend` then says ``js`` and ``backend_note`` why.

The worker contract is the one of :mod:`tabcohort.model` (docs/PROTOCOL.md, "Worker contract").
"""

from __future__ import annotations

from array import array
from typing import Any, Generator

from ..errors import ConfigError
from .mlp import MLPSpec, MLPWorker, _check_samples, as_float_list, check_len, check_offset

#: ``auto`` tries these in order (the first whose probe passes is used).
AUTO_ORDER = ("webgpu", "numpy", "js", "python")
TAB_BACKENDS = ("auto",) + AUTO_ORDER

#: A webgpu bucket is accepted at start when its gradient is within this norm-wise relative error
#: of the js kernels' on the same batch (float32 against float64 arithmetic).
PROBE_REL_TOL = 1e-4


def _kernels() -> Any:
    import js  # Pyodide only

    k = getattr(js, "tcKernels", None)
    if k is None:
        raise ConfigError("backend", "js", "the page's JS kernels (web/mlp-kernels.js) are not loaded in this worker")
    return k


def f32_js(vec: Any) -> Any:
    """A new JS ``Float32Array`` holding ``vec`` (``array('f')``; one memcpy)."""
    import js

    if not (isinstance(vec, array) and vec.typecode == "f"):
        vec = array("f", as_float_list(vec))
    t = js.Float32Array.new(len(vec))
    t.assign(vec)
    return t


def _i32_js(vec: Any) -> Any:
    import js

    a = vec if isinstance(vec, array) and vec.typecode == "i" else array("i", vec)
    t = js.Int32Array.new(len(a))
    t.assign(a)
    return t


def from_f32_js(t: Any, n: int) -> array:
    """``array('f')`` copy of a JS ``Float32Array`` of length ``n`` (one memcpy)."""
    out = array("f", bytes(4 * n))
    t.assign_to(out)
    return out


class JsMLPWorker(MLPWorker):
    """The MLP worker on the js kernels: vectors are ``array('f')``.

    Args:
        dataset: the shared dataset.
        hidden: hidden layer widths.
        activation: ``"relu"`` or ``"tanh"``.
        batch: samples per bucket.
        seed: init seed (:func:`~tabcohort.model.mlp.init_params`).
        kernels: the JS kernels module (default: the worker's ``tcKernels``).

    Raises:
        ConfigError: the kernels are not loaded, or bad arguments.
    """

    backend = "js"

    def __init__(self, dataset, *, hidden=(32,), activation="relu", batch=32, seed=0,
                 kernels: Any = None) -> None:
        self._kernels = kernels if kernels is not None else _kernels()
        self._cpu: Any = None
        self._eval_cache: tuple[Any, Any] | None = None
        #: why this backend is in use when it is not the one asked for (a fallback), or None
        self.backend_note: str | None = None
        super().__init__(dataset, hidden=hidden, activation=activation, batch=batch, seed=seed)

    def _scratch_worker(self) -> "JsMLPWorker":
        """Local steps run on the js kernels (a GPU worker's scratch included)."""
        return JsMLPWorker(self.dataset, hidden=self.mlp.layers[1:-1], activation=self.mlp.activation,
                           batch=self.batch, seed=self.seed, kernels=self._kernels)

    def _model(self) -> Any:
        if self._cpu is None:
            from pyodide.ffi import to_js

            ds = self.dataset
            self._cpu = self._kernels.CpuMLP.new(to_js(list(self.mlp.layers)), self.mlp.activation,
                                                 f32_js(ds.x_train), _i32_js(ds.y_train),
                                                 f32_js(ds.x_test), _i32_js(ds.y_test))
        return self._cpu

    def _set(self, vec: Any) -> None:
        if isinstance(vec, array) and vec.typecode == "f":
            self._p = array("f", vec)
        else:
            self._p = array("f", as_float_list(vec))
        self._push(f32_js(self._p))

    def _push(self, t: Any) -> None:
        self._model().setParams(t)
        self._eval_cache = None

    def params(self) -> array:
        """A copy of the parameters: ``array('f')`` of length ``bucket_len``."""
        return array("f", self._p)

    def apply(self, avg: Any, lr: float) -> None:
        """One SGD step: ``params = float32(params - lr * avg)``, computed in float64 (in JS).

        Raises:
            LocalProtocolError: wrong length.
        """
        check_len("avg", avg, self.bucket_len)
        t = self._model().apply(f32_js(avg), float(lr))
        self._p = from_f32_js(t, self.bucket_len)
        self._eval_cache = None
        self._after_apply(t)

    def _after_apply(self, t: Any) -> None:
        pass

    def _grad_slices(self, offset: int, n: int) -> Generator[None, None, tuple[float, array]]:
        job = self._model().begin(offset, n)   # captures the parameters of this call
        while not job.step():
            yield
        r = job.finish()
        return float(r.loss), from_f32_js(r.g, self.bucket_len)

    def _evaluate(self) -> tuple[float, float]:
        key = id(self._p)
        if self._eval_cache is None or self._eval_cache[0] != key:
            acc, loss = self._model().evaluate().to_py()
            self._eval_cache = (key, (float(acc), float(loss)))
        return self._eval_cache[1]

    def evaluate(self) -> float:
        """Accuracy in [0, 1] on the held-out split (argmax, first maximum on ties)."""
        return self._evaluate()[0]

    def evaluate_loss(self) -> float:
        """Mean softmax cross-entropy (nats) on the held-out split."""
        return self._evaluate()[1]


class GpuMLPWorker(JsMLPWorker):
    """The MLP worker on WebGPU (vectors ``array('f')``); build it with :meth:`create`.

    Attributes:
        adapter: the adapter's name as the browser reports it (e.g. ``"google swiftshader"``).
    """

    backend = "webgpu"

    def __init__(self, dataset, *, gpu: Any, **kw: Any) -> None:
        self._gpu = gpu
        self.adapter = str(gpu.adapter)
        super().__init__(dataset, **kw)

    @classmethod
    async def create(cls, dataset, *, hidden=(32,), activation="relu", batch=32, seed=0,
                     kernels: Any = None, wgsl_suffix: str = "") -> "GpuMLPWorker":
        """Compile the kernels, upload the training data and check one bucket against the js kernels.

        Args:
            wgsl_suffix: appended to the kernels' source (a test hook: ``"!"`` does not compile).

        Raises:
            Exception: no adapter, no device, a kernel that does not compile, or a probe bucket
                that differs from the js kernels' by more than :data:`PROBE_REL_TOL`
                (the message says which).
        """
        from pyodide.ffi import to_js
        import js

        k = kernels if kernels is not None else _kernels()
        ds = dataset
        spec = MLPSpec.build(ds.n_features, hidden, ds.n_classes, activation)
        opts = to_js({"layers": list(spec.layers), "activation": activation, "x": f32_js(ds.x_train),
                      "y": _i32_js(ds.y_train), "nMax": batch, "wgslSuffix": wgsl_suffix},
                     dict_converter=js.Object.fromEntries)
        gpu = await k.GpuMLP.create(opts)
        try:
            w = cls(ds, gpu=gpu, hidden=hidden, activation=activation, batch=batch, seed=seed, kernels=k)
            p = (await k.probeGpu(gpu, w._model(), min(batch, 8))).to_py()
            if not (p["rel"] <= PROBE_REL_TOL and abs(p["loss_gpu"] - p["loss_cpu"]) <= PROBE_REL_TOL * max(1.0, abs(p["loss_cpu"]))):
                raise RuntimeError(f"webgpu's probe bucket differs from the js kernels' (relative error "
                                   f"{p['rel']:.2e}, loss {p['loss_gpu']} vs {p['loss_cpu']})")
        except BaseException:
            gpu.destroy()
            raise
        return w

    def _push(self, t: Any) -> None:
        super()._push(t)
        if self._gpu is not None:
            self._gpu.setParams(t)

    def _after_apply(self, t: Any) -> None:
        if self._gpu is not None:
            self._gpu.setParams(t)

    async def _gpu_grads(self, offset: int, n: int) -> tuple[float, array]:
        r = await self._gpu.grads(offset % self.dataset.train_len, n)
        return float(r.loss), from_f32_js(r.g, self.bucket_len)

    async def keep_if_faster(self, n: int, reps: int = 3) -> None:
        """``auto``'s speed probe: time a bucket of ``n`` samples on the GPU and on the js kernels
        (after a warm-up of each), alternately, up to ``reps`` times each, and compare the
        fastest of each (the least disturbed by other work on the machine); when the GPU is
        slower (a software adapter such as SwiftShader), use js from now on and say so in
        ``backend_note``. Why not one timing each: on a loaded machine one js bucket (0.3 ms for
        the digits MLP) preempted once took longer than SwiftShader's 3 ms, and auto kept a
        backend 10x slower. A ratio past 4x either way decides after the first pair."""
        import time

        await self._gpu_grads(0, n)
        self.grads_sync(0, n)
        gpu_ms: list[float] = []
        js_ms: list[float] = []
        for _ in range(max(1, reps)):
            t0 = time.perf_counter()
            await self._gpu_grads(n, n)
            t1 = time.perf_counter()
            self.grads_sync(n, n)
            t2 = time.perf_counter()
            gpu_ms.append((t1 - t0) * 1e3)
            js_ms.append((t2 - t1) * 1e3)
            if not 0.25 <= min(gpu_ms) / max(min(js_ms), 1e-6) <= 4.0:
                break
        gpu, js = min(gpu_ms), min(js_ms)
        if gpu > js:
            self.fall_back(f"slower than js in the start probe ({gpu:.1f} ms against {js:.1f} ms for "
                           f"{n} samples, the fastest of {len(gpu_ms)} each)", failed=False)

    def fall_back(self, why: str, *, failed: bool = True) -> None:
        """Stop using the GPU: later buckets run on the js kernels; ``backend`` becomes ``js``."""
        gpu, self._gpu = self._gpu, None
        self.backend = "js"
        self.backend_note = f"webgpu ({self.adapter}) {'failed: ' if failed else 'is '}{why}; using js"
        if gpu is not None:
            try:
                gpu.destroy()
            except Exception:
                pass

    async def grads(self, offset: int, samples: int | None = None) -> tuple[float, Any]:
        """As :meth:`MLPWorker.grads`, on the GPU (on the js kernels after a fallback)."""
        off, n = check_offset(offset), _check_samples(samples, self.batch)
        if self._gpu is not None:
            try:
                return await self._gpu_grads(off, n)
            except Exception as e:  # a lost device, a kernel error, no readback: never stall
                self.fall_back(str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
        return await super().grads(off, n)


#: appended to the WGSL source when ``make_tab_worker`` is given no ``wgsl_suffix`` (test hook,
#: set by the tab runtime from the page's ``?gpuTest=bad-wgsl``)
WGSL_TEST_SUFFIX = ""


async def make_tab_worker(dataset, *, backend: str = "auto", hidden: Any = (32,), batch: int = 32,
                          seed: int = 0, activation: str = "relu", wgsl_suffix: str | None = None) -> MLPWorker:
    """Pick and build a tab's worker: ``auto`` tries webgpu > numpy > js > python, each with a probe.

    The webgpu probe compiles the kernels and checks one bucket against the js kernels; under
    ``auto`` it also times one bucket on each and keeps the js kernels when the GPU is slower
    (SwiftShader, a CPU implementation of WebGPU, is about 10x slower than js for the digits MLP).

    A forced backend (the page's ``?backend=``) is tried first; when its probe fails the rest of
    the ``auto`` order is tried and the worker's ``backend_note`` says why.

    Args:
        dataset: the shared dataset.
        backend: ``"auto"``, ``"webgpu"``, ``"numpy"``, ``"js"`` or ``"python"``.
        wgsl_suffix: appended to the WGSL source (test hook: a kernel that does not compile).

    Returns:
        A worker with a ``backend_note`` attribute (str or None).

    Raises:
        ConfigError: an unknown backend name or bad model arguments.
    """
    from .. import model

    if wgsl_suffix is None:
        wgsl_suffix = WGSL_TEST_SUFFIX
    if backend not in TAB_BACKENDS:
        raise ConfigError("backend", backend, f"expected one of {TAB_BACKENDS}")
    MLPSpec.build(dataset.n_features, hidden, dataset.n_classes, activation)   # bad model arguments raise here
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ConfigError("batch", batch, "expected an integer >= 1")
    order = AUTO_ORDER if backend == "auto" else (backend,) + tuple(b for b in AUTO_ORDER if b != backend)
    why: list[str] = []
    kw = dict(hidden=hidden, batch=batch, seed=seed, activation=activation)
    for name in order:
        try:
            if name == "webgpu":
                w: Any = await GpuMLPWorker.create(dataset, wgsl_suffix=wgsl_suffix, **kw)
                if backend != "webgpu":   # (auto, or a fallback: as auto chooses, a new-user trial)
                    await w.keep_if_faster(min(batch, 64))
            elif name == "js":
                w = JsMLPWorker(dataset, **kw)
                loss, g = w.grads_sync(0, 1)
                if not (loss == loss and len(g) == w.bucket_len):
                    raise RuntimeError("the js kernels' probe bucket is not finite")
            else:
                w = model.make_worker(dataset, backend=name, **kw)
        except Exception as e:
            text = e.reason if isinstance(e, ConfigError) else (str(e).splitlines() or [type(e).__name__])[0]
            # (the page's own words: ?backend=, not the Python API's backend='python')
            text = text.replace("(use backend='python' or 'auto')", "(?backend=js, python or auto works here)")
            why.append(f"{name}: {text[:200]}")
            continue
        inner = getattr(w, "backend_note", None) or ""
        note = "; ".join(why + [inner]).strip("; ") or None
        if backend != "auto" and why:
            # where it went first, so a report's cut (256 characters) never loses it; the worker's
            # own note may say it too (webgpu slower than js ends "; using js"): said once (it
            # read "...; using js; usin": a new-user trial)
            used = getattr(w, "backend", name)
            inner = inner[:-len(f"; using {used}")] if inner.endswith(f"; using {used}") else inner
            note = f"using {used}: {backend} was asked for but " + "; ".join(why + [inner]).strip("; ")
        w.backend_note = note
        return w
    raise ConfigError("backend", backend, "no backend works in this tab: " + "; ".join(why))
