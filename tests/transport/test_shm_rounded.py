"""The shared-memory loop of ``all_reduce(..., compress="bf16")``, driven by hand.

Two ranks' arenas map one segment in this process, and the test steps each rank's compiled
loop in turn: a loop returns whenever it would wait for the other rank (as it does to
Python in a job, which then sleeps and calls it again), so every return and resumption of
the protocol is taken, in a fixed order, without threads.
"""

from __future__ import annotations

import numpy as np

from ferrodist.core import ReduceOp, bfloat16, reducer
from ferrodist.core.kernels import plan
from ferrodist.transport._shm import loops
from ferrodist.transport._shm.arena import Arena
from ferrodist.transport._shm.segment import create_segment
from ferrodist.transport._shm.slots import bounds

CHUNK, SLOTS = 4096, 2


def start(arena: Arena, op: ReduceOp) -> np.ndarray:
    half, _, opcode = plan(bfloat16, op)
    state = loops.new_state()
    state[loops.ME], state[loops.RANKS], state[loops.SLOTS], state[loops.BYTES] = arena.rank, 2, SLOTS, CHUNK
    state[loops.SPINS], state[loops.OP], state[loops.ROOT] = 1, opcode, -1
    state[loops.CALL_ID], state[loops.NUMBER], state[loops.HALF] = 1234, 1, half
    return state


def test_a_rank_resumed_after_a_wait_folds_the_block_it_rounded_before_it():
    """MIN (not the two-rank sum, whose fold rounds this rank's block on the fly): rank 0
    rounds its own block into the caller's buffer, then must wait for rank 1 and returns;
    the resumed call folds that block from the same buffer. A loop that kept it in memory
    of its own lost it at the return. Every element must be the bits of the bfloat16
    all_reduce of the rounded inputs, widened."""
    segment = create_segment(Arena.size(2, CHUNK, SLOTS))
    arenas = [Arena.create(segment.fd, 0, 2, CHUNK, SLOTS), Arena.attach(segment.fd, 1, 2, CHUNK, SLOTS)]
    segment.release()
    rng = np.random.default_rng(5)
    n = 5000  # three chunks of 2048 bfloat16 elements
    xs = [rng.normal(0, 100, n).astype(np.float32) for _ in range(2)]
    expected = np.empty(n, bfloat16.numpy)
    reducer(bfloat16, ReduceOp.MIN)(expected, [x.astype(bfloat16.numpy) for x in xs], 1.0)
    states = [start(a, ReduceOp.MIN) for a in arenas]
    buffers = [np.full(CHUNK // 2, 0xFFFF, np.uint16) for _ in arenas]  # NaN bits: a fold of them shows

    def step(rank: int) -> int:
        a = arenas[rank]
        return loops.all_reduce_rounded(xs[rank], buffers[rank], a.data, a.words, states[rank], 1.0)

    ranks_x = [x.copy() for x in xs]
    assert step(0) == loops.WAIT and states[0][loops.PHASE] == 1  # rounded its blocks, waits for rank 1
    b0, b1 = bounds(2048, 2, 0)
    assert buffers[0][b0:b1].tobytes() == ranks_x[0][b0:b1].astype(bfloat16.numpy).tobytes()
    status = [loops.WAIT, step(1)]
    for _ in range(1000):
        if status == [loops.DONE, loops.DONE]:
            break
        for rank in (0, 1):
            if status[rank] != loops.DONE:
                status[rank] = step(rank)
                assert status[rank] != loops.MISMATCH
    assert status == [loops.DONE, loops.DONE]
    for x in xs:
        assert x.tobytes() == expected.astype(np.float32).tobytes()
    for a in arenas:
        a.close()
