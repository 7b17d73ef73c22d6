"""One rank of a benchmark job: ``python -m ferrodist.launch._bench.worker LIBRARY OUT SPEC``.

LIBRARY is ``ferrodist:<backend>`` (shm, tcp, mpi; shm-shared: shm with every tensor made by
``shared_zeros``, which the collectives read in place), ``gloo`` (torch.distributed),
``mpi4py``, or ``floor``: every rank at once streams, with numpy over private memory, the
bytes the collective must read and write on each rank (a bound no library can beat). SPEC is JSON: ops, sizes (bytes), dtype, rounds, target seconds per round.
Every rank runs the same sweep; rank 0 writes one JSON line per measurement to OUT and
prints ``progress <op> <bytes>`` lines for the driver's progress bar.

Before the first timed size, every collective runs at the sweep's first size for about
``warmup`` seconds (at least ``WARM_CALLS`` calls): what a library does once (loading
compiled kernels, its first connections and threads, touching its buffers) then lands
there, not in the first row. ferrodist compiles a kernel in the background while a first
call runs an interpreted path: after the warm-up, and after one call at each size, the
worker waits until those compiles are done (``settle``), so that only compiled code is
timed. Each measurement: two calls (to choose k), then ``rounds`` rounds of (barrier, k
back-to-back calls); the time of a call is the round's time over k; the median over rounds
is reported. k is chosen so that a round lasts about ``target`` seconds.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
#: The warm-up of each collective: at least this many calls, at most MAX_WARM_CALLS.
WARM_CALLS, MAX_WARM_CALLS = 5, 2000


class _Library(Protocol):
    rank: int
    size: int

    def barrier(self) -> None: ...

    def op(self, name: str, count: int, dtype: str) -> Callable[[], None]: ...

    def close(self) -> None: ...

    def settle(self) -> None:
        """Return once what the calls so far set going in the background is done (ferrodist:
        the kernels it compiles), so that what is timed next is the steady state."""
        return


class Ferrodist(_Library):
    def __init__(self, backend: str) -> None:
        import ferrodist.collectives as dist

        self._dist = dist
        self._shared = backend == "shm-shared"
        world = dist.init_process_group("shm" if self._shared else backend, timeout=600)
        self.rank, self.size = world.rank, world.size

    def _array(self, count: int, dtype: str) -> np.ndarray[Any, Any]:
        if not self._shared:
            return _array(count, dtype)
        x = self._dist.shared_zeros(count, dtype)
        x[...] = 1
        return x

    def barrier(self) -> None:
        self._dist.barrier()

    def op(self, name: str, count: int, dtype: str) -> Callable[[], None]:
        dist, n, make = self._dist, self.size, self._array
        x = make(count, dtype)
        if name == "all_reduce":
            return lambda: dist.all_reduce(x)
        if name == "broadcast":
            return lambda: dist.broadcast(x, 0)
        if name == "all_gather":  # count = output elements
            out, mine = make(count, dtype), make(count // n, dtype)
            return lambda: dist.all_gather(out, mine)
        out = make(count // n, dtype)  # reduce_scatter: count = input elements
        return lambda: dist.reduce_scatter(out, x)

    def close(self) -> None:
        self._dist.destroy_process_group()

    def settle(self) -> None:
        from ferrodist.core.kernels import wait_for_compiles

        wait_for_compiles(600)


class Floor(Ferrodist):
    """The memory floor: each rank reads and writes what the collective must on it, all
    ranks at once (ferrodist over TCP only for the barriers). all_reduce: read the tensor
    and a peer's worth, write the tensor (``x += y``); broadcast and all_gather: read and
    write the output once; reduce_scatter: read the input, write the rank's block."""

    def __init__(self) -> None:
        super().__init__("tcp")

    def op(self, name: str, count: int, dtype: str) -> Callable[[], None]:
        n = self.size
        x, y = _array(count, dtype), _array(count, dtype)

        def add() -> None:
            np.add(x, y, out=x)

        def copy() -> None:
            np.copyto(x, y)

        if name == "all_reduce":
            return add
        if name in ("broadcast", "all_gather"):
            return copy
        blocks, out = x.reshape(n, count // n), _array(count // n, dtype)

        def fold() -> None:
            np.add.reduce(blocks, axis=0, out=out)

        return fold


class Gloo(_Library):
    def __init__(self) -> None:
        import torch
        import torch.distributed as tdist

        self._torch, self._dist = torch, tdist
        tdist.init_process_group("gloo")
        self.rank, self.size = tdist.get_rank(), tdist.get_world_size()

    def barrier(self) -> None:
        self._dist.barrier()

    def op(self, name: str, count: int, dtype: str) -> Callable[[], None]:
        torch, dist, n = self._torch, self._dist, self.size
        kind = getattr(torch, dtype)
        x = torch.ones(count, dtype=kind)
        if name == "all_reduce":
            return lambda: dist.all_reduce(x)
        if name == "broadcast":
            return lambda: dist.broadcast(x, 0)
        if name == "all_gather":
            out, mine = torch.ones(count, dtype=kind), torch.ones(count // n, dtype=kind)
            return lambda: dist.all_gather_into_tensor(out, mine)
        out = torch.ones(count // n, dtype=kind)
        return lambda: dist.reduce_scatter_tensor(out, x)

    def close(self) -> None:
        self._dist.destroy_process_group()


class Mpi4py(_Library):
    def __init__(self) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = MPI.COMM_WORLD
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()

    def barrier(self) -> None:
        self._comm.Barrier()

    def op(self, name: str, count: int, dtype: str) -> Callable[[], None]:
        comm, MPI, n = self._comm, self._MPI, self.size
        x = _array(count, dtype)
        if name == "all_reduce":
            return lambda: comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)
        if name == "broadcast":
            return lambda: comm.Bcast(x, 0)
        if name == "all_gather":
            out, mine = _array(count, dtype), _array(count // n, dtype)
            return lambda: comm.Allgather(mine, out)
        out = _array(count // n, dtype)
        return lambda: comm.Reduce_scatter_block(x, out, MPI.SUM)

    def close(self) -> None:
        pass


def _array(count: int, dtype: str) -> np.ndarray[Any, Any]:
    from ferrodist.core import dtype as ferrodist_dtype

    return np.ones(count, ferrodist_dtype(dtype).numpy)


def _library(name: str) -> _Library:
    if name.startswith("ferrodist:"):
        return Ferrodist(name.split(":", 1)[1])
    if name == "floor":
        return Floor()
    if name == "gloo":
        return Gloo()
    if name == "mpi4py":
        return Mpi4py()
    raise SystemExit(f"unknown library {name!r}")


def main() -> None:
    name, out_path, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    lib = _library(name)
    itemsize = int(np.dtype(_array(1, spec["dtype"]).dtype).itemsize)
    if spec["sizes"]:
        warm(lib, spec["ops"], _count(lib, spec["sizes"][0], itemsize), spec["dtype"], spec.get("warmup", 0.2))
    records = []
    for op_name in spec["ops"]:
        for nbytes in spec["sizes"]:
            count = _count(lib, nbytes, itemsize)
            call = lib.op(op_name, count, spec["dtype"])
            call()  # a size's first call may set a kernel compiling (ferrodist)
            lib.settle()
            lib.barrier()
            start = time.perf_counter()
            call()
            call()
            once = max((time.perf_counter() - start) / 2, 1e-6)
            # Every rank must agree on k: take it from rank 0's estimate, rounded the same way.
            k = max(1, min(1000, int(spec["target"] / once)))
            k = _agree(lib, k)
            times = []
            for _ in range(spec["rounds"]):
                lib.barrier()
                start = time.perf_counter()
                for _ in range(k):
                    call()
                times.append((time.perf_counter() - start) / k)
            if lib.rank == 0:
                records.append(
                    {
                        "library": name,
                        "op": op_name,
                        "bytes": count * itemsize,
                        "seconds": statistics.median(times),
                        "calls_per_round": k,
                        "rounds": spec["rounds"],
                        "ranks": lib.size,
                        "dtype": spec["dtype"],
                    }
                )
                print(f"progress {op_name} {nbytes}", flush=True)
    lib.barrier()
    if lib.rank == 0:
        with open(out_path, "w") as out:
            for record in records:
                out.write(json.dumps(record) + "\n")
    lib.close()


def _count(lib: _Library, nbytes: int, itemsize: int) -> int:
    """Elements of a tensor of about ``nbytes``, a multiple of the ranks (at least one each)."""
    return max(lib.size, nbytes // itemsize // lib.size * lib.size)


def warm(lib: _Library, ops: list[str], count: int, dtype: str, seconds: float) -> None:
    """Run each of ``ops`` on ``count`` elements until about ``seconds`` have passed on rank 0
    (``WARM_CALLS`` to ``MAX_WARM_CALLS`` calls; every rank makes as many, rank 0 decides)."""
    for op_name in ops:
        call = lib.op(op_name, count, dtype)
        lib.barrier()
        start, calls = time.perf_counter(), 0
        while True:
            for _ in range(WARM_CALLS):
                call()
            calls += WARM_CALLS
            more = calls < MAX_WARM_CALLS and time.perf_counter() - start < seconds
            if not _agree(lib, int(more)):
                break
        lib.settle()


def _agree(lib: _Library, k: int) -> int:
    """The same k on every rank: rank 0's (each library broadcasts it its own way)."""
    value = np.array([k], np.int64)
    if isinstance(lib, Ferrodist):
        lib._dist.broadcast(value, 0)
    elif isinstance(lib, Gloo):
        tensor = lib._torch.from_numpy(value)
        lib._dist.broadcast(tensor, 0)
    elif isinstance(lib, Mpi4py):
        lib._comm.Bcast(value, 0)
    return int(value[0])


if __name__ == "__main__":
    main()
