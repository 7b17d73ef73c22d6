"""Fill Numba's on-disk cache while the test session runs (started by tests/conftest.py).

A cold cache costs minutes: every (dtype, op, source count) of the reduction kernels and
every dtype of the shared-memory pipelines compiles on first use, and tests that start 2
to 4 rank processes at once pay it in each process, on 2 cores. This script compiles the
same functions with the arguments the library passes, at the lowest CPU priority, so it
uses the core the serial test run leaves idle and later tests load the compiled code.
It changes no result: a test that needs a function before it is cached compiles it as
it would have anyway. ``FERRODIST_WARM_CACHE=0`` turns it off.
"""

from __future__ import annotations

import os

import numpy as np


def reducers(counts: tuple[int, ...]) -> None:
    """Every (dtype, op) kernel for ``counts`` sources, into a separate array and in place
    (a call queues the compile on ferrodist's background thread; wait for them all)."""
    from ferrodist.core import ALL_DTYPES, ReduceOp, reducer
    from ferrodist.core.kernels import wait_for_compiles

    for k in counts:
        for dt in ALL_DTYPES:
            for op in sorted(dt.ops, key=lambda o: o.value):
                fold = reducer(dt, op)
                srcs = [np.zeros(4, dt.numpy) for _ in range(k)]
                divisor = float(k) if op is ReduceOp.AVG else 1.0
                fold(np.zeros(4, dt.numpy), srcs, divisor)
                fold(srcs[0], srcs, divisor)
    wait_for_compiles()


def pipelines() -> None:
    """The shared-memory pipelines for every element type they see (bool as uint8, the
    16-bit floats as uint16 bits), with the argument types ``ShmCollectives`` passes."""
    import numba

    from ferrodist.transport import _chunks

    data, words, state = np.zeros(64, np.uint8), np.zeros(64, np.uint64), _chunks.new_state()
    for name in ("float32", "float64", "int32", "int64", "uint16", "uint8", "int8", "int16", "uint32", "uint64"):
        x = np.zeros(4, name)
        for function, args in (
            (_chunks.all_reduce_small, (x, data, words, state, 1.0)),
            (_chunks.all_reduce, (x, data, words, state, 1.0)),
            (_chunks.reduce_scatter, (x, x, data, words, state, 1.0)),
            (_chunks.broadcast, (x, data, words, state)),
            (_chunks.all_gather, (x, x, data, words, state)),
        ):
            function.compile(tuple(numba.typeof(a) for a in args))


def main() -> None:
    os.nice(19)
    reducers((2,))
    pipelines()
    reducers((3, 4, 8, 1))


if __name__ == "__main__":
    main()
