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
import gzip
import json
import logging

from .history import RoomHistory
from .rooms import Room

log = logging.getLogger("tabcohort.server")


def npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    """An ``.npy`` header for data of ``descr`` (e.g. ``<f4``) and ``shape``: the model export
    puts it before the stored checkpoint bytes, which stay undecoded."""
    from tabcohort.jobs.arrays import npy_header_for

    return npy_header_for(descr, shape)


class RoomAssets:
    """What a room serves besides its bookkeeping: the job JSON, the dataset (or a module job's
    code bundle and data), the evaluator.

    A room with ``JobConfig.job`` runs a module job (README "Write your own job"): it is loaded
    and probed here, once (:func:`tabcohort.jobs.probe`), so a bad job is a ConfigError before
    anything listens; otherwise the built-in MLP job over ``JobConfig.dataset``.
    """

    def __init__(self, room: Room) -> None:
        job = room.job
        self.job_code: bytes | None = None
        self.job_data: bytes | None = None
        if job.job:
            self._module_job(room)
        else:
            self._builtin_job(room)
        self.checkpoint_data: bytes | None = None
        #: one checkpoint upload at a time per room (each holds up to the parameters' size)
        self.upload_lock = asyncio.Lock()
        self.history = RoomHistory()

    def _builtin_job(self, room: Room) -> None:
        from tabcohort.model import load_dataset, make_worker
        from tabcohort.protocol import job_hash
        from tabcohort.protocol.optim import TrainConfig

        job = room.job
        self.dataset = load_dataset(job.dataset, seed=job.seed)
        self.worker = make_worker(self.dataset, hidden=job.hidden, batch=job.batch or job.global_batch, seed=job.seed,
                                  activation=job.activation)
        self.bucket_len = self.worker.bucket_len
        train = TrainConfig.from_job(job)
        #: float32 values of the leader's optimizer state a checkpoint carries after the
        #: parameters (PROTOCOL.md "Local steps and optimizer state"); opaque to the server
        self.state_len = train.state_len(self.bucket_len)
        self.job_hash = job_hash(self.worker.spec(), self.dataset.content_hash(), self.bucket_len, train.spec())
        d = job.public()
        d.update(room=room.name, bucket_len=self.bucket_len, state_len=self.state_len, job_hash=self.job_hash,
                 model=self.worker.spec(),
                 dataset_info={"name": self.dataset.name, "sha256": self.dataset.content_hash(),
                               "url": f"/api/rooms/{room.name}/dataset"})
        self.job_json = json.dumps(d).encode()
        self.dataset_json = json.dumps(self.dataset.to_portable()).encode()
        #: compressed once here, not per request (a recompression per GET cost training rounds)
        self.dataset_gzip = gzip.compress(self.dataset_json, compresslevel=6, mtime=0)

    @property
    def checkpoint_bytes(self) -> int:
        """A checkpoint body: the parameters, then the optimizer state (float32 LE)."""
        return 4 * (self.bucket_len + self.state_len)

    def _module_job(self, room: Room) -> None:
        from tabcohort.jobs import JobError, load_job, probe, resolve_backend

        job = room.job
        loaded = load_job(job.job)
        batch = job.batch or job.global_batch
        self.worker = probe(loaded, batch=batch, seed=job.seed)
        backends = [resolve_backend("auto")]
        if resolve_backend("auto") != "python":   # the path a tab without numpy takes
            try:
                py = loaded.make_worker(batch=batch, seed=job.seed, backend="python")
            except JobError as e:   # a numpy-only job: said so in job_info.backends
                py = None
                log.warning("job %s: no pure-Python path (tabs without numpy cannot run it): %s", job.job, e.reason)
            if py is not None:      # a pure-Python path is checked as strictly as the numpy one
                probe(loaded, batch=batch, seed=job.seed, worker=py)
                if py.bucket_len != self.worker.bucket_len:
                    raise JobError(f"bucket_len {py.bucket_len} on the python backend, "
                                   f"{self.worker.bucket_len} on {self.worker.backend}", job.job)
                backends.append("python")
        self.loaded = loaded
        self.bucket_len = self.worker.bucket_len
        from tabcohort.protocol.optim import TrainConfig
        train = TrainConfig.from_job(job)
        self.state_len = train.state_len(self.bucket_len)   # the leader's optimizer state
        self.job_hash = loaded.job_hash(self.worker, train.spec())
        self.job_code = loaded.source.bundle
        self.job_data = loaded.data.raw
        self.job_sha256 = {"job_code": loaded.source.code_sha256, "job_data": loaded.data.sha256}
        self.dataset = None
        base = f"/api/rooms/{room.name}/job"
        d = job.public()
        d.update(room=room.name, bucket_len=self.bucket_len, state_len=self.state_len, job_hash=self.job_hash, model=self.worker.spec(),
                 job_info={"name": loaded.name, "module": loaded.source.module, "factory": loaded.source.factory,
                           "spec": loaded.spec, "backends": backends,
                           "code_sha256": loaded.source.code_sha256, "code_bytes": len(self.job_code),
                           "code_url": f"{base}/code",
                           "data_sha256": loaded.data.sha256, "data_bytes": len(self.job_data),
                           "data_url": f"{base}/data"},
                 dataset_info={"name": loaded.name, "sha256": loaded.data.sha256, "url": f"{base}/data"})
        self.job_json = json.dumps(d).encode()
        self.dataset_json = self.dataset_gzip = b""
