"""all_reduce of CUDA tensors: ferrodist's staged path, its floor, and torch Gloo, in one run.

    ferrodist run -n 2 bench/gpu/all_reduce.py [--sizes 4K,1M,64M] [--reps 10] [--rounds 3] [--json PATH]

Per size, float32, every rank (median over rounds of the median of ``--reps`` calls):

- ferrodist: ``dist.all_reduce(x)`` on the CUDA tensor (host-staged, ``ferrodist.gpu``);
- floor: what any host-staged all_reduce must do, done by hand: copy ``x`` on a side
  stream into pinned memory, ferrodist's CPU all_reduce of that memory, copy it back;
- Gloo: ``torch.distributed.all_reduce`` over a Gloo group of the same ranks on the same
  CUDA tensor (torch with CUDA only).

The three run interleaved, round after round, so that drift hits them alike; the table
gives each time and the ratios ferrodist/floor (goal: at most 1.2) and Gloo/ferrodist
(above 1: ferrodist is faster). Ranks use GPU ``LOCAL_RANK % count``: with fewer GPUs than
ranks, ranks share a GPU, and the header says so.

``--json PATH`` writes the rows (rank 0): the header's facts and, per size, the seconds of
each method (``gloo_s`` is null without Gloo) and the two ratios, for tools/gpu_summary.py.

Without a GPU (``NUMBA_ENABLE_CUDASIM=1``, set here when no NVIDIA driver loads) it runs
on Numba's CUDA simulator with Numba device arrays and no Gloo column: the times then
measure the host side only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _driver_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0" if _driver_loads() else "1")  # before numba is imported

import numpy as np  # noqa: E402

import ferrodist.collectives as dist  # noqa: E402


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def pretty(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def show(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


def torch_cuda() -> Any:
    """torch, when it can make CUDA tensors here (and the simulator is off), else None."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


class Torch:
    """Tensors, copies and synchronisation through torch (a real GPU)."""

    def __init__(self, torch: Any, local_rank: int) -> None:
        self.torch = torch
        self.count = torch.cuda.device_count()
        self.device = torch.device("cuda", local_rank % self.count)
        torch.cuda.set_device(self.device)
        self.side = torch.cuda.Stream(self.device)
        self.name = torch.cuda.get_device_name(self.device)

    def tensor(self, n: int) -> Any:
        return self.torch.ones(n, dtype=self.torch.float32, device=self.device)

    def pinned(self, n: int) -> Any:
        return self.torch.empty(n, dtype=self.torch.float32, pin_memory=True)

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.device)

    def floor(self, x: Any, host: Any) -> None:
        side = self.side
        side.wait_stream(self.torch.cuda.current_stream(self.device))
        with self.torch.cuda.stream(side):
            host.copy_(x, non_blocking=True)
        side.synchronize()
        dist.all_reduce(host.numpy())
        with self.torch.cuda.stream(side):
            x.copy_(host, non_blocking=True)
        side.synchronize()


class Simulated:
    """Numba device arrays and pinned arrays (the simulator, or a GPU without torch)."""

    def __init__(self) -> None:
        from numba import cuda

        self.cuda = cuda
        self.count = 1
        self.name = "Numba's CUDA simulator" if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else "GPU (Numba)"

    def tensor(self, n: int) -> Any:
        return self.cuda.to_device(np.ones(n, np.float32))

    def pinned(self, n: int) -> Any:
        return self.cuda.pinned_array(n, np.float32)

    def sync(self) -> None:
        self.cuda.synchronize()

    def floor(self, x: Any, host: Any) -> None:
        x.copy_to_host(host)
        dist.all_reduce(host)
        x.copy_to_device(host)


def gloo_group(torch: Any, rank: int, size: int) -> Any:
    """A torch Gloo group of this job's ranks (rank 0 picks a free port and tells the rest)."""
    import torch.distributed as tdist

    port = np.zeros(1, np.int64)
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    dist.broadcast(port, 0)
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    tdist.init_process_group("gloo", init_method=f"tcp://{address}:{int(port[0])}", rank=rank, world_size=size)
    return tdist


def timed(fn: Callable[[], None], sync: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        dist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,1M,64M", help="tensor sizes in bytes (K, M, G suffixes)")
    parser.add_argument("--reps", type=int, default=10, help="calls timed per method, size and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the methods, interleaved")
    parser.add_argument("--json", type=Path, help="write the rows here as JSON (rank 0)")
    args = parser.parse_args()
    dist.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    torch = torch_cuda()
    side: Torch | Simulated = Torch(torch, int(os.environ.get("LOCAL_RANK", rank))) if torch else Simulated()
    tdist = gloo_group(torch, rank, size) if torch else None
    methods: dict[str, Callable[[Any, Any], None]] = {
        "ferrodist": lambda x, host: dist.all_reduce(x),
        "floor": side.floor,
    }
    if tdist is not None:
        methods["Gloo"] = lambda x, host: tdist.all_reduce(x)
    sharing = "one per GPU" if side.count >= size else f"sharing {side.count} GPU(s)"
    header = f"all_reduce of float32 CUDA tensors, {size} processes {sharing} ({side.name}), {dist.get_backend()}"
    rows: list[dict[str, Any]] = []
    if rank == 0:
        print(header)
        gloo = " Gloo | Gloo / ferrodist |" if tdist is not None else ""
        print(f"| size | ferrodist | floor | ferrodist / floor |{gloo}")
        print("|---|---|---|---|" + ("---|---|" if tdist is not None else ""))
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        n = nbytes // 4
        x, host = side.tensor(n), side.pinned(n)
        for method in methods.values():  # warm-up: kernels compiled, buffers allocated
            method(x, host)
        found: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(args.rounds):
            for name, method in methods.items():
                found[name].append(timed(lambda m=method, x=x, host=host: m(x, host), side.sync, args.reps))
        median = {name: statistics.median(times) for name, times in found.items()}
        gloo_s = median.get("Gloo")
        rows.append(
            {
                "bytes": nbytes,
                "size": pretty(nbytes),
                "ferrodist_s": median["ferrodist"],
                "floor_s": median["floor"],
                "ferrodist_per_floor": median["ferrodist"] / median["floor"],
                "gloo_s": gloo_s,
                "gloo_per_ferrodist": None if gloo_s is None else gloo_s / median["ferrodist"],
            }
        )
        if rank == 0:
            row = f"| {pretty(nbytes)} | {show(median['ferrodist'])} | {show(median['floor'])} | "
            row += f"{median['ferrodist'] / median['floor']:.2f} |"
            if "Gloo" in median:
                row += f" {show(median['Gloo'])} | {median['Gloo'] / median['ferrodist']:.2f}x |"
            print(row, flush=True)
    if rank == 0 and args.json is not None:
        facts = {"header": header, "processes": size, "device": side.name, "backend": dist.get_backend()}
        args.json.write_text(json.dumps({**facts, "dtype": "float32", "rows": rows}, indent=1) + "\n")
    if tdist is not None:
        tdist.destroy_process_group()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
