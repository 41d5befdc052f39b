"""The job hash carried in ``hello`` (PROTOCOL.md, "Messages"): ranks whose job differs
ignore each other, so a rank can never mix gradients of another model or dataset."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def job_hash(model: Any, dataset: str, bucket_len: int) -> str:
    """A stable hash of (model description, dataset content hash, bucket length).

    Args:
        model: a JSON-serialisable description of the model (name, layer sizes, activation).
        dataset: the dataset's content hash (hex string), which already covers the shuffle seed.
        bucket_len: number of float32 parameters (= gradient length).

    Returns:
        32 lowercase hex digits.
    """
    blob = json.dumps({"model": model, "dataset": dataset, "bucket_len": int(bucket_len)},
                      sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]
