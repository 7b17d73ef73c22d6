"""Loading the real libnccl.so.2 (no GPU needed): version, unique ids, library lookup."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytest.importorskip("ferrodist.nccl", reason="ferrodist-nccl is not installed (pip install packages/nccl)")
import ferrodist.nccl as nccl
from ferrodist.core import BackendUnavailable
from ferrodist.nccl import _library


def _define(header: str, name: str) -> int:
    match = re.search(rf"^#define {name}\s+(\d+)", header, re.MULTILINE)
    assert match, name
    return int(match.group(1))


def test_the_library_loads_from_the_wheel(library):
    assert library.path.endswith("libnccl.so.2")
    assert nccl.is_available()
    assert nccl.library_path() == library.path


def test_version_is_the_headers(nccl_header):
    expected = tuple(_define(nccl_header, f"NCCL_{part}") for part in ("MAJOR", "MINOR", "PATCH"))
    assert nccl.nccl_version() == expected
    assert _library.version_code(*expected) == _define(nccl_header, "NCCL_VERSION_CODE")


def test_version_code_follows_the_macro():
    assert _library.version_code(2, 8, 4) == 2804  # the old encoding
    assert _library.version_code(2, 9, 6) == 20906
    assert _library.version_code(2, 32, 3) == 23203


def test_unique_ids_have_the_headers_size_and_differ(nccl_header):
    size = _define(nccl_header, "NCCL_UNIQUE_ID_BYTES")
    first, second = nccl.get_unique_id(), nccl.get_unique_id()
    assert nccl.UNIQUE_ID_BYTES == size == len(first) == len(second)
    assert isinstance(first, bytes)
    assert first != second
    assert any(first)


def test_error_strings_come_from_nccl(library):
    assert library.error_string(0) == "no error"
    assert "invalid argument" in library.error_string(_library.Result.ncclInvalidArgument)
    assert library.last_error(None) == "" or isinstance(library.last_error(None), str)


def test_env_var_naming_a_missing_file_is_backend_unavailable(monkeypatch, tmp_path):
    monkeypatch.setenv("FERRODIST_NCCL_LIB", str(tmp_path / "nope" / "libnccl.so.2"))
    with pytest.raises(BackendUnavailable, match="FERRODIST_NCCL_LIB") as info:
        nccl.get_unique_id()
    assert "nvidia-nccl-cu12" in str(info.value)
    assert not nccl.is_available()


def test_env_var_naming_a_directory_without_the_library(monkeypatch, tmp_path):
    monkeypatch.setenv("FERRODIST_NCCL_LIB", str(tmp_path))
    with pytest.raises(BackendUnavailable, match="does not name a file"):
        nccl.nccl_version()


def test_env_var_naming_a_file_that_is_not_a_library(monkeypatch, tmp_path):
    fake = tmp_path / "libnccl.so.2"
    fake.write_bytes(b"not an ELF file")
    monkeypatch.setenv("FERRODIST_NCCL_LIB", str(fake))
    with pytest.raises(BackendUnavailable, match="cannot load the NCCL library") as info:
        nccl.library_path()
    assert "pip install nvidia-nccl-cu12" in str(info.value)


def test_env_var_naming_another_library_lacks_the_functions(monkeypatch):
    import importlib

    try:  # any shared library that is not NCCL: numpy's extension module
        other = importlib.import_module("numpy._core._multiarray_umath")
    except ImportError:
        other = importlib.import_module("numpy.core._multiarray_umath")
    monkeypatch.setenv("FERRODIST_NCCL_LIB", other.__file__)
    with pytest.raises(BackendUnavailable, match="no ncclGetVersion"):
        nccl.nccl_version()


def test_env_var_naming_the_real_library_is_used(monkeypatch, library):
    monkeypatch.setenv("FERRODIST_NCCL_LIB", library.path)
    assert nccl.library_path() == library.path


def test_nothing_found_names_the_wheel_and_the_env_var(monkeypatch):
    monkeypatch.delenv("FERRODIST_NCCL_LIB", raising=False)
    monkeypatch.setattr(_library, "_wheel_candidates", lambda: [])
    monkeypatch.setattr(_library.ctypes.util, "find_library", lambda name: None)
    with pytest.raises(BackendUnavailable) as info:
        _library.find_library_path()
    message = str(info.value)
    assert "pip install nvidia-nccl-cu12" in message
    assert "FERRODIST_NCCL_LIB" in message


def test_import_has_no_side_effects():
    code = (
        "import sys, ferrodist.nccl\n"
        "heavy = [m for m in sys.modules if m == 'cuda' or m.startswith(('cuda.', 'numba.cuda', 'nvidia'))]\n"
        "assert not heavy, heavy\n"
        "maps = open('/proc/self/maps').read()\n"
        "assert 'libnccl' not in maps\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_public_api_is_exactly_this():
    assert set(nccl.__all__) == {
        "DEFAULT_TIMEOUT",
        "NcclCommunicator",
        "NcclConfig",
        "NcclGroup",
        "NcclWork",
        "UNIQUE_ID_BYTES",
        "device_count",
        "get_unique_id",
        "init_nccl",
        "is_available",
        "library_path",
        "nccl_version",
    }
    assert nccl.__all__ == sorted(nccl.__all__)
    for name in nccl.__all__:
        assert getattr(nccl, name) is not None
