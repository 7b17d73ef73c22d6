"""DDP on a PyTorch CUDA module, gradients averaged through the staged GPU engine, in two
processes (`ferrodist run -n 2`) that share the machine's GPUs: needs a CUDA GPU and torch
with CUDA (skipped otherwise, with the reason).

The ranks are processes, not ``run_world`` threads: PyTorch runs the backward of every
thread's CUDA graph on one autograd thread per device, so with two ranks in one process
the first rank's DDP hook, waiting for the second rank's gradients, would hold the thread
that the second rank's backward needs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_processes import run

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _needs_gpu():
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("NUMBA_ENABLE_CUDASIM=1: the CUDA simulator cannot run torch CUDA modules")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA GPU")


@pytest.mark.parametrize("hook", ["none", "bf16"])
def test_cuda_module_trains_like_one_process(hook):
    for row in run(2, "shm", "cuda", "sgd", "on", hook):
        assert row["ok"] and row["size"] == 2, row
