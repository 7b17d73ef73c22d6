"""The bindings against more than one NCCL release.

``make test`` installs a second release (the oldest the extras allow) under
``.venv/nccl-versions/<version>``; each release found there gets the library and header tests
run again in a fresh process with ``FERRODIST_NCCL_LIB`` pointing at it. The rest checks how a
config and a missing function are reported for releases older than the newest layout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ferrodist.core import BackendUnavailable, InvalidArgument

pytest.importorskip("ferrodist.nccl", reason="ferrodist-nccl is not installed (pip install packages/nccl)")
from ferrodist.nccl import NcclConfig, _library
from ferrodist.nccl._library import CONFIG_UNDEF_INT, ConfigStruct, config_fields, config_size

HERE = Path(__file__).parent
RELEASES = Path(sys.prefix) / "nccl-versions"


def installed_releases() -> list[Path]:
    """Each ``libnccl.so.2`` under ``.venv/nccl-versions/*``."""
    return sorted(RELEASES.glob("*/nvidia/nccl/lib/libnccl.so.2"))


def test_a_second_release_is_installed_when_required():
    if not installed_releases():
        if os.environ.get("FERRODIST_REQUIRE_NCCL_VERSIONS"):
            pytest.fail(f"no second NCCL release under {RELEASES} (make test installs one)")
        pytest.skip(f"no second NCCL release under {RELEASES}")
    assert all(path.is_file() for path in installed_releases())


@pytest.mark.parametrize("path", installed_releases(), ids=lambda path: path.parents[3].name)
def test_library_and_header_tests_pass_on_another_release(path, tmp_path):
    env = {**os.environ, "FERRODIST_NCCL_LIB": str(path)}
    probe = subprocess.run(
        [sys.executable, "-c", "import ferrodist.nccl as n; print(n.nccl_version(), n.library_path())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    assert str(path) in probe.stdout
    version = tuple(int(part) for part in re.findall(r"\d+", probe.stdout.split(")")[0]))
    assert ".".join(map(str, version)) == path.parents[3].name
    assert version != _library.load_library().version, "the second release must differ from the main one"
    files = [
        str(HERE / name) for name in ("test_header.py", "test_library.py", "test_errors.py", "test_communicator.py")
    ]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", f"--basetemp={tmp_path}", *files],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=HERE.parents[1],
    )
    tail = result.stdout[-3000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    assert re.search(r"\d+ passed", result.stdout) and " failed" not in result.stdout, tail


def test_config_for_an_older_release_stops_at_its_fields():
    old = (2, 18, 3)
    config = NcclConfig(max_ctas=4, split_share=True).to_struct(old)
    assert config_fields(old)[-1] == "splitShare"
    assert config.size == config_size(old) == 48  # 8 + 4 + 4 + 4 * 4 + pointer + int, padded to 8
    assert config.version == 21803
    assert (config.maxCTAs, config.splitShare, config.minCTAs) == (4, 1, CONFIG_UNDEF_INT)
    assert config.trafficClass == 0 and config.commName is None  # past the size: zero, never read
    assert config_size(_library.CONFIG_LAYOUT_VERSION) == ConfigStruct.initialized().size


def test_an_option_the_release_lacks_is_refused_with_the_release_that_added_it():
    with pytest.raises(InvalidArgument, match=r"comm_name needs NCCL >= 2\.27.*loaded NCCL is 2\.18\.3"):
        NcclConfig(comm_name="trainer").to_struct((2, 18, 3))
    with pytest.raises(InvalidArgument, match=r"split_share needs NCCL >= 2\.18"):
        NcclConfig(split_share=False).to_struct((2, 17, 1))
    assert NcclConfig(comm_name="trainer").to_struct((2, 27, 0)).commName == b"trainer"


def test_fields_only_ever_grow_with_the_release():
    releases = sorted({since for _, _, since in _library.CONFIG_FIELDS})
    sizes = [config_size(release) for release in releases]
    assert sizes == sorted(sizes)  # an added int may fill the tail padding: equal sizes happen
    counts = [len(config_fields(release)) for release in releases]
    assert counts == sorted(set(counts)) and counts[-1] == len(_library.CONFIG_FIELDS)


def test_a_function_the_release_lacks_names_the_release_that_added_it(monkeypatch):
    library = _library.load_library()
    monkeypatch.delitem(library._functions, "ncclCommFinalize")
    monkeypatch.setattr(type(library), "version", property(lambda self: (2, 13, 4)))
    assert not library.has("ncclCommFinalize")
    with pytest.raises(
        BackendUnavailable, match=r"NCCL 2\.13\.4\) lacks ncclCommFinalize\(\) \(added in NCCL 2\.14\.0\)"
    ):
        _ = library.ncclCommFinalize
