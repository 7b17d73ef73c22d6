"""Fused k-way reduction (``reduce_many``) against chained numpy adds, in the same run.

One group per (dtype, k): ``test_<dtype>_ferrodist`` times ``reduce_many(dst, srcs, SUM)``
(one pass, k+1 buffers through memory); ``test_<dtype>_numpy_chained`` times the reference
``np.add(srcs[0], srcs[1], out=dst)`` then ``np.add(dst, s, out=dst)`` for the rest
(3(k-1) buffers). Every source is 64 MiB. Each test checks its result against the other
side once, outside the timed region, and records ``role``, ``sources`` and
``bytes_per_source`` in ``extra_info`` for ``tools/bench_ratios.py``.

Run: ``pytest bench --benchmark-only --benchmark-json=.benchmarks/kernels.json``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from ferrodist.core import ReduceOp, reduce_many
from ferrodist.core.kernels import wait_for_compiles

Array = np.ndarray[Any, Any]

SOURCE_BYTES = 64 * 2**20
ROUNDS = 7
BF16 = np.dtype(ml_dtypes.bfloat16)

F32_KS = [2, 4, 8]
BF16_KS = [2, 4]


def chained_add(dst: Array, srcs: Sequence[Array]) -> None:
    """The reference: pairwise numpy adds, left to right, into ``dst``."""
    np.add(srcs[0], srcs[1], out=dst)
    for s in srcs[2:]:
        np.add(dst, s, out=dst)


def fused_sum(dst: Array, srcs: Sequence[Array]) -> None:
    reduce_many(dst, srcs, ReduceOp.SUM)


@pytest.fixture(scope="module")
def f32_sources() -> Iterator[list[Array]]:
    """max(F32_KS) float32 sources of 64 MiB; uniform in [0, 1) so sums never cancel."""
    rng = np.random.default_rng(0)
    n = SOURCE_BYTES // 4
    srcs = [rng.random(n, dtype=np.float32) for _ in range(max(F32_KS))]
    yield srcs
    srcs.clear()


@pytest.fixture(scope="module")
def bf16_sources() -> Iterator[list[Array]]:
    """max(BF16_KS) bfloat16 sources of 64 MiB; uniform in [0, 1) so sums never cancel."""
    rng = np.random.default_rng(0)
    n = SOURCE_BYTES // 2
    srcs = [rng.random(n, dtype=np.float32).astype(BF16) for _ in range(max(BF16_KS))]
    yield srcs
    srcs.clear()


def run_pair(
    benchmark: Any,
    *,
    role: str,
    group: str,
    srcs: Sequence[Array],
    rtol: float,
) -> None:
    """Check the timed side against the other once (this also warms the JIT: a first call
    queues the kernel's compile on the background thread, waited for here), then time it."""
    timed, other = (fused_sum, chained_add) if role == "ferrodist" else (chained_add, fused_sum)
    dst = np.empty_like(srcs[0])
    expected = np.empty_like(srcs[0])
    timed(dst, srcs)
    other(expected, srcs)
    wait_for_compiles()
    np.testing.assert_allclose(dst.astype(np.float32), expected.astype(np.float32), rtol=rtol, atol=0)
    del expected

    benchmark.group = group
    benchmark.extra_info.update(role=role, sources=len(srcs), bytes_per_source=srcs[0].nbytes)
    benchmark.pedantic(timed, args=(dst, srcs), rounds=ROUNDS, warmup_rounds=1, iterations=1)


# float32: both sides add left to right in float32, so the results agree to the bit;
# the tolerance only allows for a future kernel that reassociates.
@pytest.mark.parametrize("k", F32_KS, ids=lambda k: f"k{k}")
def test_f32_ferrodist(benchmark: Any, f32_sources: list[Array], k: int) -> None:
    run_pair(benchmark, role="ferrodist", group=f"sum-f32-k{k}", srcs=f32_sources[:k], rtol=1e-6)


@pytest.mark.parametrize("k", F32_KS, ids=lambda k: f"k{k}")
def test_f32_numpy_chained(benchmark: Any, f32_sources: list[Array], k: int) -> None:
    run_pair(benchmark, role="reference", group=f"sum-f32-k{k}", srcs=f32_sources[:k], rtol=1e-6)


# bfloat16: ferrodist accumulates in float32 and rounds once; the ml_dtypes reference rounds
# after every add. With k=2 both round once (equal); with k=4 they may differ by a few
# bfloat16 ulps (2**-8 relative each), hence rtol 2**-6.
@pytest.mark.parametrize("k", BF16_KS, ids=lambda k: f"k{k}")
def test_bf16_ferrodist(benchmark: Any, bf16_sources: list[Array], k: int) -> None:
    run_pair(benchmark, role="ferrodist", group=f"sum-bf16-k{k}", srcs=bf16_sources[:k], rtol=2**-6)


@pytest.mark.parametrize("k", BF16_KS, ids=lambda k: f"k{k}")
def test_bf16_numpy_chained(benchmark: Any, bf16_sources: list[Array], k: int) -> None:
    run_pair(benchmark, role="reference", group=f"sum-bf16-k{k}", srcs=bf16_sources[:k], rtol=2**-6)
