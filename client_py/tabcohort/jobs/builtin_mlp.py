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

#: option name -> default (serve's --dataset, --hidden, --activation, --seed); ``dataset`` is
#: ``digits``, ``synthetic`` or ``npz:FILE_NAME``
OPTIONS = {"dataset": "digits", "hidden": [32], "activation": "relu", "data_seed": 0}
#: where the server reads an ``.npz`` dataset (not in the job hash: the data's sha256 is, so the
#: same file is the same job wherever it lies, and the server's paths are not published)
LOCAL_OPTIONS = {"dataset_path": None}
def _model_code_sha256():
    """sha256 of the model code this job runs (``tabcohort/model/*.py``, LF line endings): in
    the spec, so in the job hash, so ranks whose MLP code differs never mix (this file's own
    bytes are in the hash as its code bundle)."""
    import hashlib
    import os

    import tabcohort.model
    here = os.path.dirname(os.path.abspath(tabcohort.model.__file__))
    h = hashlib.sha256()
    for name in sorted(n for n in os.listdir(here) if n.endswith(".py")):
        with open(os.path.join(here, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read().replace(b"\r\n", b"\n") + b"\0")
    return h.hexdigest()


SPEC = {"name": "mlp", "model_code_sha256": _model_code_sha256()}
#: the backends the factory accepts; ``auto`` is resolved by the factory itself
BACKENDS = ("auto", "numpy", "python", "js", "webgpu")


def canonical(options):
    """``options`` with serve's ``--dataset`` given as a path split into ``dataset``
    (``npz:FILE_NAME``, hashed) and ``dataset_path`` (where it is read, absolute)."""
    import os
    d = dict(options)
    name = d.get("dataset")
    if isinstance(name, str) and name not in ("digits", "synthetic") and not name.startswith("npz:"):
        d["dataset_path"] = os.path.abspath(os.path.expanduser(name))
        d["dataset"] = "npz:" + os.path.basename(d["dataset_path"])
    return d


def load_data(options):
    """Server side only: the dataset named by ``options["dataset"]`` (``digits``,
    ``synthetic``, or ``npz:FILE_NAME`` read from ``options["dataset_path"]``, else from
    ``FILE_NAME`` in the working directory), shuffled and split with ``options["data_seed"]``."""
    from tabcohort.model import load_dataset

    name = str(options["dataset"])
    if name.startswith("npz:"):
        name = options.get("dataset_path") or name[4:]
    ds = load_dataset(name, seed=int(options["data_seed"]))
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

    return Dataset.checked(str(options["dataset"]), x_tr.shape[1],
                   int(data["n_classes"].data[0]), int(options["data_seed"]),
                   flat(x_tr, "f"), flat(data["y_train"], i4), flat(x_te, "f"), flat(data["y_test"], i4))


#: the most parameters the built-in job builds: 256 MiB of float32, a server's largest checkpoint
MAX_PARAMS = 64 << 20


def make_worker(data, *, batch, seed, backend, options):
    """The MLP worker (:class:`tabcohort.model.MLPWorker`) for ``backend``; in a tab (and for
    ``js`` and ``webgpu``) an awaitable of it from
    :func:`tabcohort.model.backend_js.make_tab_worker` (the webgpu probe is asynchronous).

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
    # in a tab every backend goes through the tab's chooser (a forced one that fails falls back,
    # with a note); js and webgpu exist only there
    if backend in ("js", "webgpu") or _in_tab():
        from tabcohort.model.backend_js import make_tab_worker
        return make_tab_worker(ds, backend=backend, **kw)
    return model.make_worker(ds, backend=backend, **kw)


def _in_tab():
    """In a tab's worker: Pyodide with the page's JS kernels (web/mlp-kernels.js) loaded."""
    if sys.platform != "emscripten":
        return False
    import js
    return getattr(js, "tcKernels", None) is not None
