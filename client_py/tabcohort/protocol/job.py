"""The job hash carried in ``hello`` (PROTOCOL.md, "Messages"): ranks whose job differs
ignore each other, so a rank can never mix gradients of another model or dataset."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def job_hash(model: Any, dataset: str, bucket_len: int, train: Any = None) -> str:
    """A stable hash of (model description, dataset content hash, bucket length, training rule).

    Args:
        model: a JSON-serialisable description of the model (name, layer sizes, activation).
        dataset: the dataset's content hash (hex string), which already covers the shuffle seed.
        bucket_len: number of float32 parameters (= gradient length).
        train: ``TrainConfig.spec()`` (local steps and optimizers, PROTOCOL.md "Local steps and
            optimizer state"), or None for the default (one synchronous SGD step per round:
            the hash it had before local steps existed). Ranks with different local steps or
            optimizers compute different buckets, so they must not meet.

    Returns:
        32 lowercase hex digits.
    """
    d = {"model": model, "dataset": dataset, "bucket_len": int(bucket_len)}
    if train is not None:
        d["train"] = train
    blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def module_job_hash(code_sha256: str, data_sha256: str, spec: Any, factory: str, bucket_len: int,
                    train: Any = None) -> str:
    """The job hash of a module job (README "Write your own job"): a stable hash of the job's
    code bundle hash, its data hash, its spec, its factory name and its bucket length, and the
    local-steps and optimizer settings when they are not the default (``TrainConfig.spec()``;
    a default room keeps its hash).

    Returns:
        32 lowercase hex digits (never equal to a :func:`job_hash`: the blob has other keys).
    """
    d = {"code": code_sha256, "data": data_sha256, "spec": spec, "factory": factory, "bucket_len": int(bucket_len)}
    if train is not None:
        d["train"] = train
    blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]
