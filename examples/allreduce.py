"""All-reduce across a fixed world of processes (tabcohort.pg).

Launch one process per rank, e.g. two on this machine (two shells):

    RANK=0 WORLD=2 PEERS=127.0.0.1:29500,127.0.0.1:29501 python examples/allreduce.py
    RANK=1 WORLD=2 PEERS=127.0.0.1:29500,127.0.0.1:29501 python examples/allreduce.py

Add TOPOLOGY=star (rank 0 is the hub; the others need no inbound port), PG_TIMEOUT_S=5,
MAX_MEMORY_BYTES=100000000. Every rank prints the same sums.
"""

from __future__ import annotations

import sys

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

from tabcohort.errors import ConfigError
from tabcohort.pg import PGError, init_process_group_sync
from tabcohort.pg.config import load_config


def main() -> int:
    if np is None:
        print("allreduce: this example needs numpy (pip install numpy)", file=sys.stderr)
        return 2
    try:
        # the settings first: a bad RANK was echoed in "rank x of 2: waiting..." above its error
        cfg = load_config()
        print(f"allreduce: rank {cfg.rank} of {cfg.world}: waiting up to {cfg.connect_timeout_s:g} s "
              f"(PG_CONNECT_TIMEOUT_S) for the other ranks...", file=sys.stderr, flush=True)
        pg = init_process_group_sync()
    except ConfigError as e:
        print(f"allreduce: configuration error: {e}", file=sys.stderr)
        return 2
    except PGError as e:  # GroupSetupError: a peer never came up within the bound
        print(f"allreduce: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    with pg:
        try:
            x = np.full(1_000_000, pg.rank + 1, dtype=np.float32)
            s = pg.all_reduce(x, op="sum")
            m = pg.all_reduce(x, op="mean", precision="bf16")
            b = pg.broadcast(np.arange(4, dtype=np.float32) * (pg.rank + 1), root=pg.world - 1)
            fa = pg.federated_average(x[:4], weight=10 * (pg.rank + 1))
            pg.barrier()
        except PGError as e:
            print(f"rank {pg.rank}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        print(f"rank {pg.rank}/{pg.world} ({pg.topology}): sum[0]={s[0]:g} (expect {pg.world * (pg.world + 1) / 2:g}), "
              f"mean bf16[0]={m[0]:g}, broadcast={b.tolist()}, federated_average[0]={fa[0]:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
