"""A room's job, built once at start: the only server module that loads a model or a job.

The server relays parameters as opaque bytes and never decodes them (docs/INTERFACES.md, "The
server"); what it needs of the job (its JSON, the dataset or a module job's code bundle and
data, ``bucket_len``, the job hash) is computed here before anything listens, so a bad job is a
ConfigError at start and no request handler runs model code. The import contract
``the server runs no protocol machine or model outside its start-up job check`` in
pyproject.toml holds every other server module to that.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from .history import RoomHistory
from .rooms import Room

log = logging.getLogger("tabcohort.server")


def npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    """An ``.npy`` header for data of ``descr`` (e.g. ``<f4``) and ``shape``: the model export
    puts it before the stored checkpoint bytes, which stay undecoded."""
    from tabcohort.jobs.arrays import npy_header_for

    return npy_header_for(descr, shape)


def job_check_bounds() -> tuple[float, float]:
    """The start-up check's bounds, seconds: ``(load_data(), the first bucket and evaluate())``
    (:data:`tabcohort.jobs.LOAD_DATA_TIMEOUT_S`, :data:`tabcohort.jobs.PROBE_TIMEOUT_S`), for
    ``tabcohort serve``'s line before the check."""
    from tabcohort.jobs import LOAD_DATA_TIMEOUT_S, PROBE_TIMEOUT_S

    return LOAD_DATA_TIMEOUT_S, PROBE_TIMEOUT_S


class RoomAssets:
    """What a room serves besides its bookkeeping: the job JSON, the job's code bundle and data.

    A room runs a job (README "Write your own job"): ``JobConfig.job``, else the built-in MLP
    job (:data:`tabcohort.jobs.BUILTIN`) with the room's dataset, hidden sizes and activation
    as its options. It is loaded and probed here, once (:func:`tabcohort.jobs.probe`), so a bad
    job is a ConfigError before anything listens.
    """

    def __init__(self, room: Room) -> None:
        self.job_code: bytes | None = None
        self.job_data: bytes | None = None
        self._load_job_named(room)
        self.checkpoint_data: bytes | None = None
        #: the model export of the newest checkpoint (``GET .../model``): (its key, the .npz bytes)
        self.model_export: tuple[tuple, bytes] | None = None
        #: one checkpoint upload at a time per room (each holds up to the parameters' size)
        self.upload_lock = asyncio.Lock()
        self.history = RoomHistory()

    @property
    def checkpoint_bytes(self) -> int:
        """A checkpoint body: the parameters, then the optimizer state (float32 LE)."""
        return 4 * (self.bucket_len + self.state_len)

    def _load_job_named(self, room: Room) -> None:
        """:meth:`_load_job`; a built-in job's error names the options that made it (``--hidden``,
        ``--dataset``, ``--activation``), not ``--job``, which the operator never gave."""
        from tabcohort.errors import ConfigError
        from tabcohort.jobs import BUILTIN, JobError

        try:
            self._load_job(room)
        except JobError as e:
            ref, options = room.job.job_ref()
            if ref != BUILTIN or e.variable != "--job":
                raise
            shown = " ".join(f"--{k}={','.join(map(str, v)) if isinstance(v, list) else v}"
                             for k, v in options.items() if k in ("hidden", "dataset", "activation"))
            raise ConfigError("--hidden", options.get("hidden"), e.reason,
                              head=f"the built-in MLP job ({shown})") from None

    @staticmethod
    def _needs_numpy(loaded: Any, ref: str, batch: int, seed: int) -> bool:
        """Whether the job's pure-Python path needs numpy where numpy cannot be imported (a tab
        without Pyodide's numpy: README "Write your own job"); when it does, one warning names
        the job and what to declare.

        The python worker built above ran in this process, where numpy is importable: a job
        importing numpy at its top level passed, was announced with backends ``numpy, python``
        and failed in every tab without numpy. Announced as numpy only, such a tab refuses it by
        name before downloading it. (A child interpreter: :func:`tabcohort.jobs.nonumpy.needs_numpy`.)
        """
        from tabcohort.jobs import PROBE_TIMEOUT_S
        from tabcohort.jobs.nonumpy import needs_numpy

        reason, note = needs_numpy(loaded, batch=batch, seed=seed, timeout_s=PROBE_TIMEOUT_S)
        if note is not None:
            log.warning("job %s: its pure-Python path was not checked where numpy cannot be imported: %s", ref, note)
        if reason is None:
            return False
        declare = ('declare BACKENDS = ("numpy",) in the job' if loaded.backends is None else
                   f"take \"python\" out of its BACKENDS ({', '.join(loaded.backends)})")
        log.warning("job %s: its pure-Python path needs numpy, which a tab without numpy cannot import (%s): "
                    "serving it on numpy only; %s to say so (README \"Write your own job\")", ref, reason, declare)
        return True

    def _load_job(self, room: Room) -> None:
        from tabcohort.jobs import (BUILTIN, PROBE_TIMEOUT_S, SHIPPED, JobError, check_round_fits, compare_paths, load_job,
                                    loss_ceiling, probe, resolve_backend)

        job = room.job
        ref, options = job.job_ref()
        if ref == BUILTIN:
            from tabcohort.jobs.builtin_mlp import canonical
            options = canonical(options)
        loaded = load_job(ref, options=options, timeout_s=PROBE_TIMEOUT_S)
        batch = job.batch or job.global_batch
        notes: list[str] = []
        self.worker = probe(loaded, batch=batch, seed=job.seed, timeout_s=PROBE_TIMEOUT_S, notes=notes)
        for note in notes:
            log.warning("job %s: %s", ref, note)
        from tabcohort.protocol.optim import TrainConfig
        train = TrainConfig.from_job(job)
        # (before the pure-Python path's check, which takes minutes on a model too large to send)
        check_round_fits(loaded, self.worker.bucket_len, train.state_len(self.worker.bucket_len))
        backends = [resolve_backend("auto")]
        accepts = list(loaded.backends) if loaded.backends else None
        if resolve_backend("auto") != "python":   # the path a tab without numpy takes
            py = None
            if loaded.backends is not None and "python" not in loaded.backends:
                # its BACKENDS leave python out (README "Write your own job"): a numpy-only job
                # (asking its factory for python anyway was a ConfigError: serve refused it)
                log.info("job %s: no pure-Python path (its BACKENDS: %s): tabs without numpy cannot run it",
                         ref, ", ".join(loaded.backends))
            else:
                try:
                    py = loaded.make_worker(batch=batch, seed=job.seed, backend="python")
                except JobError as e:   # a numpy-only job: said so in job_info.backends
                    log.warning("job %s: no pure-Python path (tabs without numpy cannot run it): %s", ref, e.reason)
            if py is not None:      # a pure-Python path is checked as strictly as the numpy one
                probe(loaded, batch=batch, seed=job.seed, worker=py, timeout_s=PROBE_TIMEOUT_S)
                if py.bucket_len != self.worker.bucket_len:
                    raise JobError(f"bucket_len {py.bucket_len} on the python backend, "
                                   f"{self.worker.bucket_len} on {self.worker.backend}", ref)
                note = compare_paths(loaded, self.worker, py, timeout_s=PROBE_TIMEOUT_S)
                if note is not None:
                    log.warning("job %s: %s", ref, note)
                backends.append("python")
                if ref not in SHIPPED and self._needs_numpy(loaded, ref, batch, job.seed):
                    backends.remove("python")   # (the shipped jobs run the no-numpy test tier)
                    if accepts is not None:
                        accepts = [b for b in accepts if b != "python"]
                        if not accepts:
                            raise JobError("its BACKENDS list only the pure-Python path, which imports numpy "
                                           "(a tab without numpy cannot run it): take numpy out of that path, "
                                           "or declare BACKENDS = (\"numpy\",)", ref)
        self.loaded = loaded
        self.bucket_len = self.worker.bucket_len
        #: the room's runaway-loss bound (README "Divergence"), or None
        self.loss_ceiling = loss_ceiling(self.worker)
        from tabcohort.jobs.worker import global_batch_note
        #: a warning for the operator when a round covers more than the training set, or None
        self.global_batch_note = global_batch_note(job.global_batch, self.worker.train_len)
        self.state_len = train.state_len(self.bucket_len)   # the leader's optimizer state
        self.job_hash = loaded.job_hash(self.worker, train.spec())
        self.job_code = loaded.source.bundle
        self.job_data = loaded.data.raw
        self.job_sha256 = {"job_code": loaded.source.code_sha256, "job_data": loaded.data.sha256}
        base = f"/api/rooms/{room.name}/job"
        d = job.public()
        d.update(room=room.name, bucket_len=self.bucket_len, state_len=self.state_len, job_hash=self.job_hash, model=self.worker.spec(),
                 job_info={"name": loaded.name, "module": loaded.source.module, "factory": loaded.source.factory,
                           "spec": loaded.spec, "options": loaded.options, "backends": backends,
                           "accepts": accepts,
                           "builtin": ref == BUILTIN,
                           "code_sha256": loaded.source.code_sha256, "code_bytes": len(self.job_code),
                           "code_url": f"{base}/code",
                           "data_sha256": loaded.data.sha256, "data_bytes": len(self.job_data),
                           "data_url": f"{base}/data"},
                 dataset_info={"name": loaded.options["dataset"] if ref == BUILTIN else loaded.name,
                               "sha256": loaded.data.sha256,
                               "url": f"{base}/data"})
        self.job_json = json.dumps(d).encode()
