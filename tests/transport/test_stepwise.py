"""The shared-memory protocol in Python (``stepwise``) keeps its compiled twins' numbers.

Ranks that run ``stepwise`` and ranks that run ``loops`` meet in one call (see
tests/integration/test_cold_cache.py, which runs both in one job); here the pieces that
decide the bits: the blocks of a chunk, and the fold of more ranks than one kernel reads.
"""

from __future__ import annotations

import numpy as np

from ferrodist.core import ReduceOp, bfloat16, float16, float32, reducer
from ferrodist.core.kernels import MAX_FUSED_SOURCES
from ferrodist.transport._shm import slots, stepwise


def test_the_blocks_of_a_chunk_are_the_compiled_loops_blocks():
    for m in (1, 2, 7, 64, 1000, 1 << 18):
        for p in (1, 2, 3, 4, 7, 9):
            assert stepwise.split(m, p) == [slots.bounds(m, p, q) for q in range(p)], (m, p)


def test_more_half_ranks_than_one_kernel_reads_accumulate_in_float32_and_round_once():
    """The compiled loops fold every rank in float32 and round once; ``reducer`` rounds each
    group of ``MAX_FUSED_SOURCES``, so the steps must not use it there."""
    ranks = MAX_FUSED_SOURCES + 3
    rng = np.random.default_rng(3)
    for dt in (bfloat16, float16):
        srcs = [rng.normal(0, 1000, 4096).astype(np.float32).astype(dt.numpy) for _ in range(ranks)]
        for op, divisor in ((ReduceOp.SUM, 1.0), (ReduceOp.AVG, float(ranks))):
            out = np.empty(4096, dt.numpy)
            stepwise.fold_for(dt, op, ranks)(out, srcs, divisor)
            total = np.zeros(4096, np.float32)
            for s in srcs:
                total += s.astype(np.float32)
            if divisor != 1.0:
                total /= np.float32(divisor)
            expected = total.astype(dt.numpy)  # one rounding, to nearest-even
            assert out.view(np.uint16).tolist() == expected.view(np.uint16).tolist(), (dt.name, op)


def test_other_folds_are_reducer():
    assert stepwise.fold_for(float32, ReduceOp.SUM, MAX_FUSED_SOURCES + 3) is reducer(float32, ReduceOp.SUM)
    assert stepwise.fold_for(bfloat16, ReduceOp.SUM, MAX_FUSED_SOURCES) is reducer(bfloat16, ReduceOp.SUM)
