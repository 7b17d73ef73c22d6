"""The proof: N ranks training on shards end with the model one process gets on the
whole batch (ferrodist.nn, in-process ranks; real processes in test_processes.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

pytest.importorskip("ferrodist.nn", reason="ferrodist-nn is not installed (pip install packages/nn)")
pytest.importorskip("ferrodist.ddp", reason="ferrodist-ddp is not installed (pip install packages/ddp)")
from _training import max_difference, train_ddp, train_reference

from ferrodist.collectives import default_group
from ferrodist.testing import run_world


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("overlap", [True, False])
def test_ranks_train_exactly_like_one_process_float64(size: int, optimizer: str, overlap: bool) -> None:
    reference = train_reference(optimizer)
    # tiny buckets: several buckets per step, so overlap really starts them during backward
    results = run_world(
        size,
        lambda: train_ddp(default_group(), optimizer, overlap=overlap, bucket_cap_mb=0.001, first_bucket_cap_mb=0.0002),
    )
    for rank, state in enumerate(results):
        assert max_difference(state, reference) <= 1e-10, f"rank {rank}"
        assert max_difference(state, results[0]) == 0.0, f"rank {rank} differs from rank 0"


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_float32_within_stated_tolerance(optimizer: str) -> None:
    reference = train_reference(optimizer, dtype=np.float32)
    results = run_world(2, lambda: train_ddp(default_group(), optimizer, dtype=np.float32))
    for state in results:
        assert max_difference(state, reference) <= 1e-5
