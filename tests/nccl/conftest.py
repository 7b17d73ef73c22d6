"""Fixtures for the NCCL tests: the shipped nccl.h, and whether a real GPU is here."""

from __future__ import annotations

from pathlib import Path

import pytest


def header_path(library_path: str) -> Path | None:
    """The nccl.h shipped beside ``library_path`` (a wheel's ``lib/../include``, or /usr/include)."""
    beside = Path(library_path).resolve().parent.parent / "include" / "nccl.h"
    if beside.is_file():
        return beside
    system = Path("/usr/include/nccl.h")
    return system if library_path.startswith("/usr/") and system.is_file() else None


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
def nccl_header(library) -> str:
    """The text of the nccl.h of the loaded library's release."""
    path = header_path(library.path)
    if path is None:
        pytest.skip(f"no nccl.h beside {library.path} (pip install nvidia-nccl-cu12)")
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
