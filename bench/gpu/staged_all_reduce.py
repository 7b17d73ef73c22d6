"""Host-staged GPU all_reduce against a whole-tensor host round trip, in the same run.

    ferrodist run -n 2 bench/gpu/staged_all_reduce.py [--sizes 4K,1M,64M] [--reps 10]

On a GPU machine (``NUMBA_ENABLE_CUDASIM=0``) this times both paths. Without one it runs
on the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, the default here), where kernel times
mean nothing: use small sizes and read the bytes columns, which are what the staging
path costs on the host side whatever the GPU.

Columns per size: median time of each path, bytes copied device->host and host->device
per rank per call, and the host buffers each path holds (staged: per-thread, reused and
bounded by the segment size; round trip: a full-size copy per call).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np

import ferrodist.collectives as dist
import ferrodist.core as fc
from ferrodist.gpu import engine


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def staged(x: fc.Tensor) -> None:
    dist.all_reduce(x)


def round_trip(x: fc.Tensor) -> None:
    """The seeds' GPU path: the whole tensor to the host, a CPU all_reduce, back."""
    host = x.to("cpu").numpy()
    dist.all_reduce(host)
    x.device_array().copy_to_device(host)


def measure(fn, x: fc.Tensor, reps: int) -> float:
    fn(x)  # warm-up: kernels compiled, buffers allocated
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,64K")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    stats = engine().stats
    where = "CUDA simulator" if os.environ["NUMBA_ENABLE_CUDASIM"] == "1" else "GPU"
    if rank == 0:
        print(f"host-staged all_reduce, float32, {size} ranks, {where}, segment {engine().segment_bytes} B")
        print(
            "| size | staged | round trip | staged bytes D2H / H2D per rank | round trip D2H / H2D | "
            "host buffers held staged / round trip |"
        )
        print("|---|---|---|---|---|---|")
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        x = fc.as_tensor(np.ones(nbytes // 4, np.float32)).to("cuda")
        before = stats.snapshot()
        t_staged = measure(staged, x, args.reps)
        after = stats.snapshot()
        calls = args.reps + 1
        d2h, h2d = ((a - b) // calls for a, b in zip(after, before, strict=True))
        t_trip = measure(round_trip, x, args.reps)
        if rank == 0:
            print(
                f"| {nbytes} B | {t_staged * 1e3:.3f} ms | {t_trip * 1e3:.3f} ms | {d2h} / {h2d} | "
                f"{nbytes} / {nbytes} | {engine().host_bytes()} / {nbytes} |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
