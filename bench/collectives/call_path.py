"""Where the time of a small all_reduce goes: the module function, the group, the runner
and the transport's own collective, each timed on its own in one job.

    ferrodist run -n 2 bench/collectives/call_path.py [--bytes 4096] [--calls 20000] [--dtype bfloat16]

Each rank times ``--calls`` calls of: ``ferrodist.collectives.all_reduce`` (the module
function), ``ProcessGroup.all_reduce`` (the group: its plan found from the arguments),
the group's runner with that plan (ordering, deadline, failure handling around the body)
and the transport's own collective called directly (the shm arena's compiled small
all_reduce, with a deadline and call number made up here). Each layer's cost is its time
less the next one's. Run it on shm (the default under ``ferrodist run``): other transports
have no collective of their own to call directly.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import numpy as np

import ferrodist.collectives as dist
from ferrodist.core import ReduceOp, dtype


def mean_us(run: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--dtype", default="float32", help="element type (default float32)")
    args = parser.parse_args()
    group = dist.init_process_group()
    dt = dtype(args.dtype)
    x = np.ones(args.bytes // dt.itemsize, dt.numpy)
    for _ in range(2000):  # plans made, kernels compiled
        dist.all_reduce(x)
    signature = ("all_reduce", x.dtype, x.size, ReduceOp.SUM, None, None)
    plan = group._route.known(signature)  # the plan the calls above made
    native = group._route.native
    if plan is None or native is None:
        print("call_path.py: run it on shm (ferrodist run -n 2 ...): this transport has no collective of its own")
        return 2
    module = mean_us(lambda: dist.all_reduce(x), args.calls)
    method = mean_us(lambda: group.all_reduce(x), args.calls)
    runner = mean_us(lambda: group._runner.run(plan, (x,), False, None), args.calls)
    seq = [group._runner.order.turn + 10]  # past every call the group made: numbers of their own

    def direct() -> None:
        seq[0] += 1
        native.all_reduce(x, dt, ReduceOp.SUM, time.monotonic() + 30, plan.fingerprint, seq[0])

    transport = mean_us(direct, args.calls)  # the group makes no call after these
    if group.rank == 0:
        print(
            f"all_reduce of {args.bytes} bytes of {dt.name}, {group.size} ranks over {type(group.transport).__name__}:"
        )
        print("| layer | time of a call | its own share |")
        print("|---|---|---|")
        rows = [
            ("module function", module, module - method),
            ("ProcessGroup.all_reduce", method, method - runner),
            ("runner with the plan", runner, runner - transport),
            ("transport's own collective", transport, transport),
        ]
        for name, took, own in rows:
            print(f"| {name} | {took:.2f} us | {own:.2f} us |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
