"""Real processes on 127.0.0.1: every collective for 2, 3 and 4 ranks in mesh and star, checked
bit for bit against numpy computed here (tabcohort.pg.group semantics)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tabcohort.wire import FrameWriter

from .worker import N_ODD, N_SMALL, OPS, PRECISIONS, inputs

pytestmark = [pytest.mark.integration, pytest.mark.needs_numpy, pytest.mark.timeout(120)]


def q(x: np.ndarray, precision: str) -> np.ndarray:
    if precision == "f32":
        return x
    return np.asarray(FrameWriter(0, precision=precision).quantize(x), dtype=np.float32)


def expected_all_reduce(world: int, n: int, op: str, precision: str) -> np.ndarray:
    parts = [q(inputs(r, n), precision) for r in range(world)]
    f = {"sum": np.add, "mean": np.add, "min": np.minimum, "max": np.maximum}[op]
    acc = functools.reduce(lambda a, b: f(a, b).astype(np.float32), parts)
    if op == "mean":
        acc = (acc / np.float32(world)).astype(np.float32)
    return q(acc, precision)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("topology", ["mesh", "star"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_collective(run_group, world, topology):
    check_every_collective(run_group(world, topology), world)


def check_every_collective(res: list[dict], world: int) -> None:
    """Every rank of a ``mode=all`` run exited 0 with every result equal, bit for bit, to numpy's."""
    for item in res:
        assert item["rc"] == 0 and "arrays" in item, item["log"][-3000:]
    got = [item["arrays"] for item in res]
    for n in (N_ODD, N_SMALL):
        for p in PRECISIONS:
            for op in OPS:
                want = expected_all_reduce(world, n, op, p)
                for r in range(world):
                    np.testing.assert_array_equal(bits(got[r][f"ar_{n}_{p}_{op}"]), bits(want),
                                                  err_msg=f"rank {r} n={n} {p} {op}")
    want2d = functools.reduce(lambda a, b: (a + b).astype(np.float32),
                              [inputs(r, 12).reshape(3, 4) for r in range(world)])
    for r in range(world):
        assert got[r]["ar_2d"].shape == (3, 4)
        np.testing.assert_array_equal(bits(got[r]["ar_2d"]), bits(want2d))
        np.testing.assert_array_equal(bits(got[r]["ar_array"]),
                                      bits(functools.reduce(lambda a, b: (a + b).astype(np.float32),
                                                            [inputs(i, 10) for i in range(world)])))
        for root in range(world):
            np.testing.assert_array_equal(bits(got[r][f"bc_{root}"]), bits(inputs(root, N_ODD, salt=root)))
    w = np.arange(1, world + 1, dtype=np.float64)
    acc = np.zeros(N_ODD)
    for r in range(world):
        acc += w[r] * inputs(r, N_ODD).astype(np.float64)
    fa = (acc / w.sum()).astype(np.float32)
    for r in range(world):
        np.testing.assert_array_equal(bits(got[r]["fa"]), bits(fa))
