"""The built-in job: a multilayer perceptron over a classification dataset (README "Write your
own job"; the worker contract is docs/PROTOCOL.md, "Worker contract").

It is a job like any other: ``tabcohort serve`` without ``--job`` serves this module, its code
bundle and data, and every rank builds its worker from them through :mod:`tabcohort.jobs`. Its
options (:data:`OPTIONS`) come from serve's ``--dataset``, ``--hidden``, ``--activation`` and
``--seed``; they are part of its spec, so of the job hash.

Data: ``x_train`` float32 ``(train_len, n_features)``, ``y_train`` int32 ``(train_len,)``,
``x_test``, ``y_test`` likewise, ``n_classes`` int32 ``(1,)``: the seeded split of
:func:`tabcohort.model.load_dataset`. Backends: ``numpy`` and ``python`` everywhere; in a tab
(Pyodide) also ``js`` and ``webgpu``, and ``auto`` there tries webgpu > numpy > js > python
(:func:`tabcohort.model.backend_js.make_tab_worker`).
"""

import sys

#: option name -> default (serve's --dataset, --hidden, --activation, --seed)
OPTIONS = {"dataset": "digits", "hidden": [32], "activation": "relu", "data_seed": 0}
SPEC = {"name": "mlp"}
#: the backends the factory accepts; ``auto`` is resolved by the factory itself
BACKENDS = ("auto", "numpy", "python", "js", "webgpu")


def canonical(options):
    """``options`` with an ``.npz`` dataset path made absolute (the same file is the same job,
    and a model export evaluates, from any directory)."""
    import os
    d = dict(options)
    name = d.get("dataset")
    if isinstance(name, str) and name not in ("digits", "synthetic"):
        d["dataset"] = os.path.abspath(os.path.expanduser(name))
    return d


def load_data(options):
    """Server side only: the dataset named by ``options["dataset"]`` (``digits``,
    ``synthetic``, or an ``.npz`` path), shuffled and split with ``options["data_seed"]``."""
    from tabcohort.model import load_dataset

    ds = load_dataset(options["dataset"], seed=int(options["data_seed"]))
    return to_arrays(ds)


def to_arrays(ds):
    """A :class:`tabcohort.model.Dataset` as the job's data (see the module docstring)."""
    from array import array

    from tabcohort.jobs.arrays import NdArray
    i4 = "i" if array("i").itemsize == 4 else "l"
    f = ds.n_features
    return {"x_train": NdArray("<f4", (ds.train_len, f), ds.x_train),
            "y_train": NdArray("<i4", (ds.train_len,), ds.y_train),
            "x_test": NdArray("<f4", (ds.test_len, f), ds.x_test),
            "y_test": NdArray("<i4", (ds.test_len,), ds.y_test),
            "n_classes": NdArray("<i4", (1,), array(i4, [ds.n_classes]))}


def dataset_of(data, options):
    """The :class:`tabcohort.model.Dataset` of the job's data, checked (its shapes, finite
    features, labels in range: it crossed the network).

    Raises:
        ConfigError: a missing array or one of the wrong shape, dtype or values.
    """
    from tabcohort.errors import ConfigError

    for key, dims, descr in (("x_train", 2, "<f4"), ("y_train", 1, "<i4"), ("x_test", 2, "<f4"),
                             ("y_test", 1, "<i4"), ("n_classes", 1, "<i4")):
        a = data.get(key)
        if a is None or len(a.shape) != dims or a.descr != descr:
            raise ConfigError(f"data.{key}", None if a is None else f"{a.descr} {a.shape}",
                              f"the built-in job needs {descr} of {dims} dimension(s)")
    if data["x_train"].shape[0] != data["y_train"].shape[0] or data["x_test"].shape[0] != data["y_test"].shape[0] \
            or data["x_train"].shape[1] != data["x_test"].shape[1] or data["n_classes"].shape != (1,):
        raise ConfigError("data", "shapes", "the arrays' rows or features do not match")
    from array import array

    from tabcohort.model import Dataset
    x_tr, x_te = data["x_train"], data["x_test"]
    i4 = "i" if array("i").itemsize == 4 else "l"

    def flat(a, code):
        v = a.data
        return v if isinstance(v, array) and v.typecode == code else array(code, v)

    name = str(options["dataset"])
    return Dataset.checked(name if name in ("digits", "synthetic") else "npz:" + name.replace("\\", "/").rsplit("/", 1)[-1],
                   x_tr.shape[1],
                   int(data["n_classes"].data[0]), int(options["data_seed"]),
                   flat(x_tr, "f"), flat(data["y_train"], i4), flat(x_te, "f"), flat(data["y_test"], i4))


#: the most parameters the built-in job builds: 256 MiB of float32, a server's largest checkpoint
MAX_PARAMS = 64 << 20


def make_worker(data, *, batch, seed, backend, options):
    """The MLP worker (:class:`tabcohort.model.MLPWorker`) for ``backend``; for ``js``,
    ``webgpu``, and ``auto`` in a tab, an awaitable of it (the webgpu probe is asynchronous).

    Raises:
        ConfigError: a bad backend or model arguments (``hidden``, ``activation``), or a model
            of more than :data:`MAX_PARAMS` parameters.
    """
    from tabcohort import model

    from tabcohort.errors import ConfigError

    ds = dataset_of(data, options)
    hidden = options["hidden"]
    if not isinstance(hidden, (list, tuple)) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 1
                                                        for h in hidden):
        raise ConfigError("hidden", hidden, "expected a list of layer widths >= 1")
    sizes = [ds.n_features, *hidden, ds.n_classes]
    n = sum((a + 1) * b for a, b in zip(sizes, sizes[1:]))
    if n > MAX_PARAMS:
        raise ConfigError("hidden", ",".join(map(str, hidden)), f"the MLP would have {n:,} parameters "
                          f"({4 * n / 2**20:,.0f} MiB of float32); at most {MAX_PARAMS:,} (a checkpoint is "
                          "at most 256 MiB)")
    kw = dict(hidden=tuple(options["hidden"]), activation=options["activation"], batch=batch, seed=seed)
    if backend in ("js", "webgpu") or backend == "auto" and _in_tab():
        from tabcohort.model.backend_js import make_tab_worker
        return make_tab_worker(ds, backend=backend, **kw)
    return model.make_worker(ds, backend=backend, **kw)


def _in_tab():
    """In a tab's worker: Pyodide with the page's JS kernels (web/mlp-kernels.js) loaded."""
    if sys.platform != "emscripten":
        return False
    import js
    return getattr(js, "tcKernels", None) is not None
