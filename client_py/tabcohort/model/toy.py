"""A tiny, exact worker for protocol tests, simulations and benchmarks.

The model is least squares towards a target that depends on the sample index:
``loss_i = 0.5 * ||p - t_i||^2`` with ``t_i[j] = ((i * 7 + j * 13) % 17) / 17``, so the
optimum is the mean target and every offset gives a different, deterministic gradient.
It implements the worker contract (PROTOCOL.md, "Worker contract") in pure Python, and
returns this process's vector type (numpy float32 when importable).
"""

from __future__ import annotations

from array import array
from typing import Any

from ..errors import LocalProtocolError
from ..vec import to_vector


class ToyWorker:
    """Least-squares toy worker.

    Args:
        bucket_len: number of parameters.
        batch: samples per bucket.
        train_len: size of the virtual training set (offsets index it modulo this).
        backend: the backend name to report.
        compute_ms: simulated compute time per bucket in :meth:`grads` (an awaited sleep, so
            it costs loop time, not CPU: benchmarks use it so two cores do not limit scaling).
    """

    model = "toy-lsq"

    def __init__(self, bucket_len: int = 8, batch: int = 4, *, train_len: int = 1000,
                 backend: str = "python", compute_ms: float = 0.0) -> None:
        self.bucket_len = int(bucket_len)
        self.batch = int(batch)
        self.train_len = int(train_len)
        self.backend = backend
        self.compute_ms = float(compute_ms)
        self._p = array("f", [0.0] * self.bucket_len)
        self.calls = 0
        self.nan_offsets: set[int] = set()   # knob: offsets whose bucket is NaN (tests)
        self.fail_next = 0                   # knob: the next N grads() raise (tests)

    def _target(self, i: int, j: int) -> float:
        return ((i * 7 + j * 13) % 17) / 17.0

    def _targets(self, r: int) -> list[float]:
        """Targets of every sample index i with i % 17 == r (they repeat with period 17)."""
        table = self.__dict__.setdefault("_table", {})
        row = table.get(r)
        if row is None:
            row = table[r] = [self._target(r, j) for j in range(self.bucket_len)]
        return row

    def grads_sync(self, offset: int, samples: int | None = None) -> tuple[float, Any]:
        """Mean loss and gradient over samples ``offset .. offset+samples-1`` (mod train_len);
        ``samples`` defaults to ``batch``."""
        self.calls += 1
        if self.fail_next > 0:
            self.fail_next -= 1
            raise RuntimeError("injected worker failure")
        n = self.bucket_len
        p = self._p
        g = [0.0] * n
        loss = 0.0
        nb = self.batch if samples is None else int(samples)
        for s in range(nb):
            t = self._targets(((offset + s) % self.train_len) % 17)
            for j in range(n):
                d = p[j] - t[j]
                g[j] += d
                loss += 0.5 * d * d
        b = float(nb)
        if offset in self.nan_offsets:
            g[0] = float("nan")
        return loss / b, to_vector([x / b for x in g])

    async def grads(self, offset: int, samples: int | None = None) -> tuple[float, Any]:
        result = self.grads_sync(offset, samples)   # against the parameters held when compute starts
        if self.compute_ms > 0:
            import asyncio
            await asyncio.sleep(self.compute_ms / 1000.0)
        return result

    def local_grads_sync(self, offset: int, samples: int, steps: int, optimizer: str = "sgd",
                         lr: float = 0.1) -> tuple[float, Any]:
        """H inner steps on a scratch copy from the current parameters; returns the mean inner
        loss and the pseudo-gradient (docs/PROTOCOL.md, "Local steps and optimizer state")."""
        from .mlp import run_slices
        return run_slices(self._local(offset, samples, steps, optimizer, lr, None))

    async def local_grads(self, offset: int, samples: int, steps: int, optimizer: str = "sgd",
                          lr: float = 0.1, should_stop: Any = None) -> tuple[float, Any] | None:
        """H inner steps (each costs ``compute_ms`` of loop time when it is set), abandoned
        between steps when ``should_stop()`` is true."""
        import asyncio
        slices = self._local(offset, samples, steps, optimizer, lr, should_stop)
        pause_s = self.compute_ms / 1000.0
        while True:
            try:
                next(slices)
            except StopIteration as done:
                result = done.value
                break
            await asyncio.sleep(pause_s)        # between inner steps: one step's compute time
        if pause_s > 0 and result is not None:
            await asyncio.sleep(pause_s)        # the last step's
        return result

    def _local(self, offset: int, samples: int, steps: int, optimizer: str, lr: float, should_stop: Any) -> Any:
        from .local import local_slices

        scratch = ToyWorker(self.bucket_len, self.batch, train_len=self.train_len, backend=self.backend)
        scratch.nan_offsets = self.nan_offsets
        self.calls += 1

        def grad_slices(w: "ToyWorker", o: int, n: int) -> Any:
            return w.grads_sync(o, n)
            yield  # pragma: no cover - a generator without slices

        return local_slices(scratch, self.params(), offset, samples, steps, optimizer, lr, grad_slices,
                            should_stop)

    def apply(self, avg: Any, lr: float) -> None:
        p = self._p
        for j in range(self.bucket_len):
            p[j] = p[j] - lr * float(avg[j])

    def params(self) -> Any:
        return to_vector(self._p)

    def set_params(self, p: Any) -> None:
        if len(p) != self.bucket_len:
            raise LocalProtocolError(f"expected {self.bucket_len} parameters, got {len(p)}")
        self._p = array("f", [float(x) for x in p])

    def evaluate(self) -> float:
        """A pseudo-accuracy in [0, 1]: 1 / (1 + distance to the optimum)."""
        return 1.0 / (1.0 + sum(abs(float(x) - 0.5) for x in self._p) / self.bucket_len)

    def spec(self) -> dict:
        return {"name": self.model, "bucket_len": self.bucket_len}
