"""The reduction kernels against three references measured in the same run.

For each case (dtype, op, k sources of ``--mib`` MiB each) this times, median of
``--rounds``:

- ferrodist: ``reduce_many(dst, srcs, op)`` (one pass: k + 1 buffers through memory);
- plain Numba: the loop anyone would write (``acc += src[i]`` over the tuple, in njit),
  for SUM on dtypes numpy adds natively (else "-");
- numpy chained: ``np.add(a, b, out=dst)`` then ``np.<op>(dst, s, out=dst)`` per source
  (3(k-1) buffers; for AVG a division at the end);
- copy floor: ``np.copyto`` of one source into ``dst`` (2 buffers), scaled by (k+1)/2:
  what moving the kernel's bytes costs on this machine.

Prints a Markdown table with numpy/ferrodist (higher is better) and ferrodist/floor (1.0
is memory speed). ``--inplace`` adds the case where ``dst`` is the second source.

Usage: ``python bench/core/kernels.py [--mib 64] [--rounds 7] [--all]``
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numba
import numpy as np

from ferrodist.core import ALL_DTYPES, ReduceOp, dtype, reduce_many
from ferrodist.core.kernels import wait_for_compiles

Array = np.ndarray[Any, Any]

UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
DEFAULT_CASES = [
    ("float32", ReduceOp.SUM, 2),
    ("float32", ReduceOp.SUM, 3),
    ("float32", ReduceOp.SUM, 4),
    ("float32", ReduceOp.SUM, 8),
    ("float32", ReduceOp.AVG, 4),
    ("float32", ReduceOp.MAX, 4),
    ("float64", ReduceOp.SUM, 4),
    ("int32", ReduceOp.SUM, 4),
    ("int8", ReduceOp.BXOR, 4),
    ("bfloat16", ReduceOp.SUM, 2),
    ("bfloat16", ReduceOp.SUM, 4),
    ("float16", ReduceOp.SUM, 4),
]


@numba.njit(nogil=True)
def plain_sum(dst, srcs):  # type: ignore[no-untyped-def]
    for i in range(dst.shape[0]):
        acc = srcs[0][i]
        for s in range(1, len(srcs)):
            acc += srcs[s][i]
        dst[i] = acc


def median_ms(fn: Callable[[], None], rounds: int) -> float:
    fn()  # warm-up: a first call queues the kernel's compile on the background thread
    wait_for_compiles()
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def sources(name: str, k: int, nbytes: int) -> list[Array]:
    dt = dtype(name).numpy
    n = nbytes // dt.itemsize
    rng = np.random.default_rng(0)
    if np.issubdtype(dt, np.integer) or dt == np.bool_:
        return [rng.integers(0, 2, n).astype(dt) for _ in range(k)]
    return [rng.random(n, dtype=np.float32).astype(dt) for _ in range(k)]


def chained(dst: Array, srcs: Sequence[Array], op: ReduceOp) -> None:
    ufunc = UFUNC[op]
    ufunc(srcs[0], srcs[1], out=dst)
    for s in srcs[2:]:
        ufunc(dst, s, out=dst)
    if op is ReduceOp.AVG:
        np.divide(dst, len(srcs), out=dst)


def run_case(name: str, op: ReduceOp, k: int, nbytes: int, rounds: int, inplace: bool) -> dict[str, Any]:
    srcs = sources(name, k, nbytes)
    dst = srcs[1] if inplace else np.empty_like(srcs[0])
    row: dict[str, Any] = {"case": f"{op.name.lower()}-{name}-k{k}" + ("-inplace" if inplace else "")}
    row["ferrodist"] = median_ms(lambda: reduce_many(dst, srcs, op), rounds)
    native = dtype(name).numpy.kind in "iuf" and name not in ("bfloat16", "float16")  # Numba: no 16-bit floats
    row["plain"] = median_ms(lambda: plain_sum(dst, tuple(srcs)), rounds) if op is ReduceOp.SUM and native else None
    if not inplace:
        row["numpy"] = median_ms(lambda: chained(dst, srcs, op), rounds)
    floor_dst = np.empty_like(srcs[0])
    row["floor"] = median_ms(lambda: np.copyto(floor_dst, srcs[0]), rounds) * (k + 1) / 2
    return row


def cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB per source (default 64)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per measurement (default 7)")
    parser.add_argument("--all", action="store_true", help="every (dtype, op) of the kernel table at k = 2, 4, 8")
    parser.add_argument("--inplace", action="store_true", help="also time dst = the second source")
    parser.add_argument("--json", default=None, help="also write every row (milliseconds) to this file")
    args = parser.parse_args(argv)
    cases = DEFAULT_CASES
    if args.all:
        cases = [(d.name, op, k) for d in ALL_DTYPES for op in sorted(d.ops, key=lambda o: o.value) for k in (2, 4, 8)]
    print(f"{args.mib} MiB per source, median of {args.rounds}; times in ms; ml_dtypes {ml_dtypes.__version__}")
    print("| case | ferrodist | plain Numba | numpy chained | copy floor | numpy/ferrodist | ferrodist/floor |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for name, op, k in cases:
        for inplace in (False, True) if args.inplace else (False,):
            row = run_case(name, op, k, args.mib * 2**20, args.rounds, inplace)
            rows.append(row)
            speedup = f"{row['numpy'] / row['ferrodist']:.2f}x" if row.get("numpy") else "-"
            print(
                f"| {row['case']} | {cell(row['ferrodist'])} | {cell(row['plain'])} | {cell(row.get('numpy'))} | "
                f"{cell(row['floor'])} | {speedup} | {row['ferrodist'] / row['floor']:.2f} |",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"mib": args.mib, "rounds": args.rounds, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
