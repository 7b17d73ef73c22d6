"""Device reduction kernels against torch's ``add_`` on the same GPU, in one run.

    NUMBA_ENABLE_CUDASIM=0 python bench/gpu/kernels.py [--elements 67108864] [--reps 20]

``dst += src`` over ``--elements`` elements of float32, bfloat16 and float16: ferrodist's
``reduce_into`` (8-byte loads: two float32 or four halves per load, float32 arithmetic
for the halves, one rounding) and torch's ``dst.add_(src)``, each timed with CUDA events
(median of ``--reps``). Bandwidth counts three passes over the data (read dst, read src,
write dst). Prints one Markdown table with the ratio to torch (goals of issue 14: float32
at least 0.90, the halves at least 0.80). Needs a GPU and torch with CUDA.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any


def timed(torch: Any, fn: Any, reps: int) -> float:
    fn()  # warm-up (and compilation)
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=64 << 20, help="elements per array")
    parser.add_argument("--reps", type=int, default=20, help="timed launches per kernel")
    args = parser.parse_args()
    import torch

    import ferrodist.core as fc
    from ferrodist.gpu import reduce_into

    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu/kernels.py needs a GPU and torch with CUDA")
    n = args.elements
    print(f"dst += src, {n} elements, {torch.cuda.get_device_name()}, median of {args.reps} (CUDA events)")
    print("| dtype | ferrodist reduce_into | torch add_ | ferrodist / torch |")
    print("|---|---|---|---|")
    for name in ("float32", "bfloat16", "float16"):
        kind = getattr(torch, name)
        dst = torch.rand(n, device="cuda").to(kind)
        src = torch.rand(n, device="cuda").to(kind)
        ours = fc.as_tensor(dst).device_array()
        theirs_src = fc.as_tensor(src).device_array()
        t_ours = timed(torch, lambda a=ours, b=theirs_src, dt=name: reduce_into(a, b, dt), args.reps)
        t_torch = timed(torch, lambda a=dst, b=src: a.add_(b), args.reps)
        nbytes = 3 * n * dst.element_size()
        print(
            f"| {name} | {nbytes / t_ours / 1e9:.0f} GB/s | {nbytes / t_torch / 1e9:.0f} GB/s | "
            f"{t_torch / t_ours:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
