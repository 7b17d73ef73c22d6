"""Per-call overhead: the Python time of one tiny collective, where moving bytes costs nothing.

A world of one simulated rank runs the whole call path (argument checks, fingerprint,
call number, algorithm) with no peer to wait for. Latencies between processes (shared
memory, TCP) come from `ferrodist bench`. The reference in the same run is numpy's own
in-place add of the same 4-byte array.

Run: ``pytest bench/collectives --benchmark-only``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import ferrodist.collectives as dist


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    dist.init_process_group("simulated")
    yield
    dist.destroy_process_group()


@pytest.mark.benchmark(group="overhead-4-bytes")
def test_all_reduce_4_bytes_simulated(benchmark: Any, world: None) -> None:
    x = np.ones(1, np.float32)
    dist.all_reduce(x)
    benchmark.extra_info.update(role="ferrodist", sources=1, bytes_per_source=4)
    benchmark(dist.all_reduce, x)
    assert x[0] == 1.0  # one rank: the sum is the value itself


@pytest.mark.benchmark(group="overhead-4-bytes")
def test_numpy_add_4_bytes(benchmark: Any) -> None:
    x = np.ones(1, np.float32)
    y = np.zeros(1, np.float32)
    benchmark.extra_info.update(role="reference", sources=1, bytes_per_source=4)
    benchmark(np.add, x, y, out=x)
    assert x[0] == 1.0
