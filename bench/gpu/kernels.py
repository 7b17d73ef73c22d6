"""Device reduction kernels against torch's ``add_`` on the same GPU, in one run.

    NUMBA_ENABLE_CUDASIM=0 python bench/gpu/kernels.py [--elements 67108864] [--reps 20] [--batch 10]
        [--dtypes float32,bfloat16,float16] [--json PATH]

``dst += src`` over ``--elements`` elements of each dtype: ferrodist's ``reduce_into`` on
the torch tensors themselves (no copy; 16-byte vector loads and stores for aligned arrays,
float32 arithmetic for the halves, one rounding) and torch's ``dst.add_(src)``. Each is
first checked to give torch's bits (torch also adds halves in float32 and rounds once), then
timed with CUDA events around ``--batch`` back-to-back launches (so that Python's launch
overhead overlaps the kernels, as in a training loop), median of ``--reps`` such batches.
Bandwidth counts three passes over the data (read dst, read src, write dst). Prints one
Markdown table with the ratio to torch (goals: float32 at least 0.90, the halves at least
0.80); ``--json PATH`` also writes the rows (dtype, ours_gbps, torch_gbps, ratio, same_bits,
error) for tools/gpu_summary.py.

A dtype that fails (an exception, or bits that differ from torch's) gets a row saying so and
the others still run; the exit status is 1 if any did, else 0. Needs a GPU and torch with
CUDA (exit status 2 without them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


def timed(torch: Any, fn: Any, reps: int, batch: int) -> float:
    """Median seconds of one call of ``fn``, timed in batches of ``batch`` back-to-back calls."""
    fn()  # warm-up (and compilation)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3 / batch)
    return statistics.median(times)


def measure(torch: Any, name: str, n: int, reps: int, batch: int) -> dict[str, Any]:
    """One row: both bandwidths and their ratio, after checking ferrodist against torch's bits."""
    import ferrodist.core as fc
    from ferrodist.gpu import reduce_into

    kind = getattr(torch, name)
    generator = torch.Generator(device="cuda").manual_seed(0)
    dst = torch.rand(n, device="cuda", generator=generator).to(kind)
    src = torch.rand(n, device="cuda", generator=generator).to(kind)
    ours, theirs = dst.clone(), dst.clone()
    reduce_into(ours, src)  # the dtype comes from the tensor (bfloat16 too)
    theirs.add_(src)
    bits = torch.int32 if dst.element_size() == 4 else torch.int16
    same = bool(torch.equal(ours.view(bits), theirs.view(bits)))
    del ours, theirs
    # Timed on the device arrays under the tensors, as the staged engine calls it (a torch
    # tensor costs an as_tensor per call; bfloat16's array is int16, the dtype says bfloat16).
    a, b = fc.as_tensor(dst).device_array(), fc.as_tensor(src).device_array()
    t_ours = timed(torch, lambda: reduce_into(a, b, name), reps, batch)
    t_torch = timed(torch, lambda: dst.add_(src), reps, batch)
    nbytes = 3 * n * dst.element_size()
    return {
        "dtype": name,
        "ours_gbps": nbytes / t_ours / 1e9,
        "torch_gbps": nbytes / t_torch / 1e9,
        "ratio": t_torch / t_ours,
        "same_bits": same,
        "error": None if same else "reduce_into's bits differ from torch add_'s",
    }


def failed(name: str, exc: BaseException) -> dict[str, Any]:
    traceback.print_exception(exc, file=sys.stderr)
    error = f"{type(exc).__name__}: {exc}"
    return {"dtype": name, "ours_gbps": None, "torch_gbps": None, "ratio": None, "same_bits": None, "error": error}


def table_row(row: dict[str, Any]) -> str:
    if row["ratio"] is None:
        return f"| {row['dtype']} | failed | | | {row['error']} |"
    check = "yes" if row["same_bits"] else "NO"
    return f"| {row['dtype']} | {row['ours_gbps']:.0f} GB/s | {row['torch_gbps']:.0f} GB/s | {row['ratio']:.2f} | {check} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--elements", type=int, default=64 << 20, help="elements per array")
    parser.add_argument("--reps", type=int, default=20, help="timed batches per kernel (the median is reported)")
    parser.add_argument("--batch", type=int, default=10, help="back-to-back launches per timed batch")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated, of " + ", ".join(DTYPES))
    parser.add_argument("--json", type=Path, help="write the rows here as JSON")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.dtypes.split(",") if name.strip()]
    unknown = sorted(set(names) - set(DTYPES))
    if unknown:
        parser.error(f"unknown dtypes {', '.join(unknown)}; choose from {', '.join(DTYPES)}")
    try:
        import torch
    except ImportError:
        print("bench/gpu/kernels.py needs torch with CUDA: pip install torch", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench/gpu/kernels.py needs a GPU and torch with CUDA", file=sys.stderr)
        return 2

    n = args.elements
    device = torch.cuda.get_device_name()
    print(f"dst += src, {n} elements, {device}, median of {args.reps} batches of {args.batch} launches (CUDA events)")
    print("| dtype | ferrodist reduce_into | torch add_ | ferrodist / torch | same bits as torch |")
    print("|---|---|---|---|---|")
    rows = []
    for name in names:
        try:
            row = measure(torch, name, n, args.reps, args.batch)
        except Exception as exc:  # one dtype's failure is its row; the others still run
            row = failed(name, exc)
        rows.append(row)
        print(table_row(row), flush=True)
    if args.json is not None:
        facts = {"device": device, "elements": n, "reps": args.reps, "batch": args.batch}
        args.json.write_text(json.dumps({**facts, "rows": rows}, indent=1) + "\n")
    return 1 if any(row["error"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
