"""One rank of a test process group (run as a subprocess by tests/pg).

Configured from the environment (RANK, WORLD, PEERS, TOPOLOGY, ...) plus PG_TEST_MODE and
PG_TEST_OUT (a path; results go to OUT.npz, outcome to OUT.json).

Modes: ``all`` runs every collective in sequence; ``die`` (rank WORLD-1 exits mid-all_reduce);
``hang`` (rank WORLD-1 never calls); ``mismatch`` (rank 1 passes another length); ``memory``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import numpy as np

from tabcohort.pg import init_process_group

N_ODD = 1000  # not a multiple of the 256-element shard unit
N_SMALL = 5  # fewer elements than ranks x 256: some mesh shards are empty
PRECISIONS = ("f32", "f16", "bf16", "int8")
OPS = ("sum", "mean", "min", "max")


def inputs(rank: int, n: int, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + 7 * n + salt)
    return (rng.standard_normal(n) * 3).astype(np.float32)


async def run_all(pg) -> dict:
    out = {}
    r = pg.rank
    for n in (N_ODD, N_SMALL):
        for p in PRECISIONS:
            for op in OPS:
                out[f"ar_{n}_{p}_{op}"] = await pg.all_reduce(inputs(r, n), op, precision=p)
    out["ar_2d"] = await pg.all_reduce(inputs(r, 12).reshape(3, 4), "sum")
    for root in range(pg.world):
        out[f"bc_{root}"] = await pg.broadcast(inputs(r, N_ODD, salt=root), root=root)
    await pg.barrier()
    out["fa"] = await pg.federated_average(inputs(r, N_ODD), weight=r + 1)
    import array
    out["ar_array"] = np.frombuffer(await pg.all_reduce(array.array("f", inputs(r, 10)), "sum"), dtype=np.float32)
    return out


async def main() -> int | None:
    mode = os.environ.get("PG_TEST_MODE", "all")
    path = os.environ["PG_TEST_OUT"]
    t0 = time.monotonic()
    try:
        pg = await init_process_group()
    except Exception as e:  # noqa: BLE001 - a bring-up error is an outcome too
        with open(path + ".json", "w") as f:
            json.dump({"error": type(e).__name__, "message": str(e), "elapsed_s": time.monotonic() - t0}, f)
        return 2
    r, w = pg.rank, pg.world
    outcome: dict = {"rank": r, "error": None, "connect_s": time.monotonic() - t0}
    if hasattr(pg.bus, "transport_bytes"):
        outcome["links"] = pg.bus.links()
    try:
        if mode == "all":
            res = await run_all(pg)
            np.savez(path + ".npz", **res)
            if hasattr(pg.bus, "transport_bytes"):
                outcome["transport_bytes"] = pg.bus.transport_bytes()
                outcome["links_after"] = pg.bus.links()
        else:
            await pg.barrier()
            t0 = time.monotonic()
            try:
                if mode == "die" and r == int(os.environ.get("PG_TEST_DIE_RANK", w - 1)):
                    if os.environ.get("PG_TEST_DIE_BEFORE_SEND"):
                        if pg.topology == "mesh":
                            # die once every other rank is inside the all_reduce (its shard for this
                            # rank arrived): dying earlier could break a survivor's barrier, whose
                            # message from a third rank may still be on its way
                            end = time.monotonic() + 10.0
                            while time.monotonic() < end and not all(
                                    (pg._seq, j, 0) in pg._box for j in range(w) if j != r):
                                await asyncio.sleep(0.005)  # polling this rank's inbox, bounded
                        os._exit(3)
                    task = asyncio.ensure_future(pg.all_reduce(inputs(r, N_ODD)))  # noqa: F841 - sends, then dies
                    await asyncio.sleep(0)
                    os._exit(3)
                if mode == "hang" and r == w - 1:  # a stuck rank: late by 3 timeouts, then goes on
                    await asyncio.sleep(3 * float(os.environ["PG_TIMEOUT_S"]))
                n = N_ODD + 1 if (mode == "mismatch" and r == 1) else N_ODD
                await pg.all_reduce(inputs(r, n), precision="f32")
            except Exception as e:  # noqa: BLE001 - the outcome is what the test checks
                outcome["error"] = type(e).__name__
                outcome["message"] = str(e)
                outcome["lost_rank"] = getattr(e, "rank", None)
            outcome["elapsed_s"] = time.monotonic() - t0
            try:
                await pg.barrier()
                outcome["later"] = None
            except Exception as e:  # noqa: BLE001
                outcome["later"] = type(e).__name__
                outcome["later_notes"] = list(getattr(e, "__notes__", []))
    finally:
        with open(path + ".json", "w") as f:
            json.dump(outcome, f)
        await pg.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
