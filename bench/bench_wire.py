"""Wire benchmark (docs/INTERFACES.md, "Wire"): encoded size per precision relative to f32, and
encode+decode throughput of the stdlib path relative to the numpy path, side by side in one run.

    PYTHONPATH=client_py python bench/bench_wire.py [--n 1000000] [--json bench/results/bench_wire.json]

Prints a Markdown table on stdout and writes the same results as JSON. Sizes are whole frames
(a ``round`` message: chunk headers, frame header and all), chunked at the data-channel limit.
The expected size ratios: f16/bf16 0.5, int8 0.25 + 1/block (one float32 scale per block).
"""

from __future__ import annotations

import argparse
import array
import json
import os
import platform
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "client_py"))

from tabcohort._compat import np  # noqa: E402
from tabcohort.wire import DATA_CHANNEL_MAX_MESSAGE_BYTES, FrameReader, FrameWriter  # noqa: E402

PRECISIONS = ["f32", "f16", "bf16", "int8"]


def round_msg(params) -> dict:
    return {"t": "round", "term": 1, "step": 1, "lr": 0.1, "loss": 1.0, "samples": 64, "cohort": 4,
            "assign": {1: 0, 2: 64, 3: 128, 4: 192}, "shares": {1: 64, 2: 64, 3: 64, 4: 64},
            "cursor": 0, "params": params}


def time_path(prec: str, params, use_numpy: bool, reps: int, block: int) -> tuple[float, int]:
    """Best-of-``reps`` seconds for write + feed of one round; and its encoded bytes."""
    best = float("inf")
    size = 0
    for _ in range(reps):
        w = FrameWriter(1, precision=prec, max_message_bytes=DATA_CHANNEL_MAX_MESSAGE_BYTES,
                        int8_block=block, use_numpy=use_numpy)
        r = FrameReader(use_numpy=use_numpy)
        t0 = time.perf_counter()
        chunks = w.write(round_msg(params))
        out = [m for c in chunks for m in r.feed(c, now_ms=0.0)]
        best = min(best, time.perf_counter() - t0)
        if len(out) != 1:
            raise RuntimeError(f"{prec}: frame did not decode: {r.drops}")
        size = sum(map(len, chunks))
    return best, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="parameters in the vector")
    ap.add_argument("--block", type=int, default=256, help="int8 block size")
    ap.add_argument("--reps-py", type=int, default=2)
    ap.add_argument("--reps-np", type=int, default=5)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                   "results", "bench_wire.json"))
    args = ap.parse_args()
    rng = random.Random(0)
    params_py = array.array("f", (rng.gauss(0.0, 0.05) for _ in range(args.n)))
    params_np = np.frombuffer(params_py.tobytes(), dtype=np.float32).copy() if np is not None else None
    expected = {"f32": 1.0, "f16": 0.5, "bf16": 0.5, "int8": 0.25 + 1.0 / args.block}
    rows = []
    f32_size = None
    for prec in PRECISIONS:
        t_py, size_py = time_path(prec, params_py, False, args.reps_py, args.block)
        row = {"precision": prec, "bytes": size_py}
        if params_np is not None:
            t_np, size_np = time_path(prec, params_np, True, args.reps_np, args.block)
            if size_np != size_py:
                raise RuntimeError(f"{prec}: numpy and stdlib frame sizes differ")
            row.update(np_melem_s=args.n / t_np / 1e6, py_over_np=t_np / t_py)
        row["py_melem_s"] = args.n / t_py / 1e6
        f32_size = f32_size or size_py
        row["ratio_to_f32"] = size_py / f32_size
        row["expected_ratio"] = expected[prec]
        row["within_1pct"] = abs(row["ratio_to_f32"] - expected[prec]) <= 0.01 * expected[prec]
        rows.append(row)
    result = {
        "n_params": args.n, "int8_block": args.block,
        "int8_scale_overhead_bytes_per_element": 4.0 / args.block,
        "max_message_bytes": DATA_CHANNEL_MAX_MESSAGE_BYTES,
        "python": platform.python_version(), "numpy": getattr(np, "__version__", None),
        "machine": platform.machine(), "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"# wire: {args.n:,} params, int8 block {args.block}, chunks <= {DATA_CHANNEL_MAX_MESSAGE_BYTES} B,"
          f" Python {result['python']}, numpy {result['numpy']}\n")
    print("| precision | frame bytes | size / f32 | expected | within 1 % | stdlib Melem/s |"
          " numpy Melem/s | stdlib / numpy throughput |")
    print("|---|---:|---:|---:|:---:|---:|---:|---:|")
    for r in rows:
        npcol = f"{r['np_melem_s']:.1f}" if "np_melem_s" in r else "n/a"
        ratio = f"{r['py_over_np']:.3f}" if "py_over_np" in r else "n/a"
        print(f"| {r['precision']} | {r['bytes']:,} | {r['ratio_to_f32']:.4f} | {r['expected_ratio']:.4f} |"
              f" {'yes' if r['within_1pct'] else 'NO'} | {r['py_melem_s']:.2f} | {npcol} | {ratio} |")
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
