"""DDP on a PyTorch CUDA module, gradients averaged through the staged GPU engine: needs a
CUDA GPU and torch with CUDA (skipped otherwise, with the reason). Never run here yet:
this machine has no GPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from ferrodist.collectives import default_group

pytest.importorskip("ferrodist.ddp", reason="ferrodist-ddp is not installed (pip install packages/ddp)")
from ferrodist.ddp import DDP, bf16_compress
from ferrodist.testing import run_world

sys.path.insert(0, str(Path(__file__).parent))

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _needs_gpu():
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("NUMBA_ENABLE_CUDASIM=1: the CUDA simulator cannot run torch CUDA modules")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA GPU")


@pytest.mark.parametrize("hook", [None, bf16_compress])
def test_cuda_module_trains_like_one_process(hook):
    from test_torch_models import batches, make_model, optimizer

    def train(size_hint):
        rank, size = default_group().rank, default_group().size
        model = DDP(make_model(torch.float32, 10 * rank).cuda(), comm_hook=hook, bucket_cap_mb=0.005)
        opt = optimizer("sgd", model.parameters())
        per = 16 // size
        for x, y in batches(torch.float32):
            opt.zero_grad()
            xs, ys = x[rank * per : (rank + 1) * per].cuda(), y[rank * per : (rank + 1) * per].cuda()
            torch.nn.functional.cross_entropy(model(xs), ys).backward()
            opt.step()
        assert all(b.buffer.is_cuda for b in model.buckets)
        return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}

    from test_torch_models import reference

    ref = reference("sgd", torch.float32)
    tolerance = 1e-4 if hook is None else 2e-2
    for state in run_world(2, train, 2):
        assert max(float(np.max(np.abs(state[k] - ref[k]))) for k in ref) <= tolerance
