"""Run by tests/integration/test_real_processes.py as
`NUMBA_ENABLE_CUDASIM=1 ferrodist run -n N gpu_properties.py CASES BACKEND`.

The cases of properties.py, with every array argument moved to a CUDA tensor before the
call and the results copied back after it, so the host-staged GPU collectives run over a
real transport between real processes (on Numba's CUDA simulator here). Shapes are kept
under 200 elements: the simulator runs every GPU thread in Python.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import properties

import ferrodist.collectives as dist
import ferrodist.core as fc


class OnDevice:
    """``ferrodist.collectives`` as properties.py uses it, but every numpy argument travels
    as a CUDA tensor and is copied back into the caller's array afterwards."""

    def __getattr__(self, name):
        fn = getattr(dist, name)

        def call(*args, **kwargs):
            moved = []

            def to_device(value):
                if isinstance(value, np.ndarray):
                    tensor = fc.as_tensor(np.ascontiguousarray(value)).to("cuda")
                    moved.append((value, tensor))
                    return tensor
                if isinstance(value, list) and value and isinstance(value[0], np.ndarray):
                    return [to_device(v) for v in value]
                return value

            result = fn(*[to_device(a) for a in args], **{k: to_device(v) for k, v in kwargs.items()})
            for array, tensor in moved:
                if array.flags.writeable:
                    array[...] = tensor.to("cpu").numpy().reshape(array.shape)
            return result

        return call


def small_shape(rng: np.random.Generator) -> tuple[int, ...]:
    shape = real_shape_for(rng)
    return (int(rng.integers(60, 200)),) if shape and shape[0] >= 60 else shape


# Integers wrap on a GPU; the simulator computes with numpy scalars, which warn as they wrap.
warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)
real_shape_for = properties.shape_for
properties.shape_for = small_shape
properties.dist = OnDevice()


def main() -> None:
    total, backend = int(sys.argv[1]), sys.argv[2]
    world = dist.init_process_group(backend, timeout=120)
    rank, size = world.rank, world.size
    cases = properties.planned_cases()[:total]
    for index, (kind, dt, op) in enumerate(cases):
        properties.run_case(index, kind, dt, op, size, rank)
    # p2p on device: a ring of isend/irecv
    x = fc.as_tensor(np.full(5, rank, np.int64)).to("cuda")
    got = fc.as_tensor(np.zeros(5, np.int64)).to("cuda")
    recv = dist.irecv(got, (rank - 1) % size, tag=7)
    dist.isend(x, (rank + 1) % size, tag=7).wait(60)
    recv.wait(60)
    np.testing.assert_array_equal(got.to("cpu").numpy(), np.full(5, (rank - 1) % size))
    dist.barrier()
    print(f"rank {rank} of {size}: {len(cases)} device cases passed over {backend}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
