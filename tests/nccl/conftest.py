"""Fixtures for the NCCL tests: the shipped nccl.h, and whether a real GPU is here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def header_path() -> Path | None:
    """nccl.h from the nvidia-nccl wheel, or None."""
    spec = importlib.util.find_spec("nvidia.nccl")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "include" / "nccl.h"
        if candidate.is_file():
            return candidate
    return None


def gpu_skip_reason(minimum: int = 1) -> str | None:
    """Why GPU tests cannot run here (None when at least ``minimum`` GPUs are usable)."""
    try:
        from ferrodist.nccl import device_count

        count = device_count()
    except Exception as exc:  # no driver, no cuda-python, ...
        return f"needs a CUDA GPU: {type(exc).__name__}: {exc}"
    if count < minimum:
        return f"needs {minimum} CUDA GPU(s); cudaGetDeviceCount says {count}"
    return None


@pytest.fixture(scope="session")
def nccl_header() -> str:
    path = header_path()
    if path is None:
        pytest.skip("nccl.h is not installed (pip install nvidia-nccl-cu12)")
    return path.read_text()


@pytest.fixture(scope="session")
def library():
    from ferrodist.nccl._library import load_library

    return load_library()


@pytest.fixture
def gpu() -> None:
    """Skip unless at least one usable CUDA GPU is here."""
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def two_gpus() -> None:
    """Skip unless at least two usable CUDA GPUs are here."""
    reason = gpu_skip_reason(2)
    if reason:
        pytest.skip(reason)


@pytest.fixture
def no_gpu() -> None:
    """Skip when a GPU is usable (the test checks the no-GPU errors)."""
    if gpu_skip_reason() is None:
        pytest.skip("a CUDA GPU is present; this test checks the behaviour without one")
