"""Host-staged collectives on real device memory: needs a CUDA GPU and
``NUMBA_ENABLE_CUDASIM=0`` (skipped otherwise, with the reason)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import ferrodist.collectives as dist
import ferrodist.core as fc
from ferrodist.testing import run_world

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("staged_route")]


def _real_gpu() -> str | None:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return "NUMBA_ENABLE_CUDASIM=1: the CUDA simulator stands in for the GPU (run with NUMBA_ENABLE_CUDASIM=0)"
    try:
        fc.as_tensor(np.zeros(1, np.float32)).to("cuda")
    except fc.DeviceUnavailable as exc:
        return f"no CUDA GPU: {exc}"
    return None


@pytest.fixture(autouse=True)
def _needs_gpu():
    reason = _real_gpu()
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("nbytes", [4, 4096, 3 << 20, 9 << 20])
def test_staged_collectives_on_device_memory(nbytes):
    n = nbytes // 4

    def rank_main():
        r, size = dist.get_rank(), dist.get_world_size()
        x = fc.as_tensor(np.arange(n, dtype=np.float32) + r).to("cuda")
        dist.all_reduce(x)
        y = fc.as_tensor(np.full(n, r, np.int32)).to("cuda")
        dist.broadcast(y, src=size - 1)
        out = fc.as_tensor(np.zeros(size * n, np.float32)).to("cuda")
        dist.all_gather(out, fc.as_tensor(np.full(n, r, np.float32)).to("cuda"))
        z = fc.as_tensor(np.full(n, r + 1.0, np.float32)).to("cuda")
        dist.all_reduce(z, "avg", compress="bf16")
        return x.to("cpu").numpy(), y.to("cpu").numpy(), out.to("cpu").numpy(), z.to("cpu").numpy()

    base = np.arange(n, dtype=np.float64)
    for x, y, out, z in run_world(3, rank_main):
        np.testing.assert_allclose(x, 3 * base + 3, rtol=1e-6)
        np.testing.assert_array_equal(y, np.full(n, 2, np.int32))
        np.testing.assert_array_equal(out, np.repeat(np.arange(3, dtype=np.float32), n))
        np.testing.assert_array_equal(z, np.full(n, 2.0, np.float32))


def test_torch_cuda_tensors_find_their_plan_by_address(checks_made):
    """A repeated all_reduce of a PyTorch CUDA tensor (bfloat16 too) skips the checks and
    the Numba view: one check per rank and kind of call; a strided tensor is still refused."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA GPU")
    made = checks_made

    def rank_main():
        r = dist.get_rank()
        x = torch.full((1000,), float(r + 1), device="cuda")
        h = torch.full((10,), float(r + 1), device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            dist.all_reduce(x)
            dist.all_reduce(h)
        with pytest.raises(fc.InvalidArgument, match="contiguous"):
            dist.all_reduce(torch.ones(8, device="cuda")[::2])
        return x.cpu().tolist(), h.float().cpu().tolist()

    for x, h in run_world(2, rank_main):
        assert x == [12.0] * 1000 and h == [12.0] * 10
    assert sorted(made) == ["all_reduce"] * 6
