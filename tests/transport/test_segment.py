"""The shm arena's segment: a memfd opened through /proc, or a named file swept when its creator is gone."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

import pytest

from ferrodist.core import InvalidArgument
from ferrodist.transport._shm.segment import (
    SegmentGone,
    _pid_namespace,
    create_segment,
    open_segment,
    sweep_dead_segments,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux shared memory")


def test_a_memfd_segment_has_no_name_and_is_shared_through_its_address(tmp_path):
    segment = create_segment(4096, directory=str(tmp_path))
    assert segment.address.startswith(f"memfd {os.getpid()} ") and segment.path is None
    assert list(tmp_path.iterdir()) == []
    other = open_segment(segment.address, 4096)
    mine, theirs = mmap.mmap(segment.fd, 4096), mmap.mmap(other, 4096)
    mine[:5] = b"hello"
    assert theirs[:5] == b"hello"
    os.close(other)
    segment.release()
    with pytest.raises(SegmentGone, match="no longer exists"):
        open_segment(segment.address, 4096)
    mine.close()
    theirs.close()


def test_a_segment_of_another_size_or_another_inode_is_refused():
    segment = create_segment(4096)
    try:
        with pytest.raises(InvalidArgument, match="FERRODIST_SHM_CHUNK"):
            open_segment(segment.address, 8192)
        kind, pid, fd, inode = segment.address.split()
        with pytest.raises(SegmentGone, match="pid was reused"):
            open_segment(f"{kind} {pid} {fd} {int(inode) + 1}", 4096)
    finally:
        segment.release()


def test_without_memfd_the_file_goes_at_release_and_dead_creators_files_are_swept(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRODIST_SHM_MEMFD", "0")
    monkeypatch.setenv("FERRODIST_JOB_ID", "abc123")
    ns = _pid_namespace()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    left = tmp_path / f"ferrodist-old1-{ns}-{dead_pid}-0a0b"  # its creator has exited
    alive = tmp_path / f"ferrodist-old2-{ns}-{os.getppid()}-0a0b"  # its creator runs
    foreign = tmp_path / f"ferrodist-old3-{ns + 1}-{dead_pid}-0a0b"  # another PID namespace: unknown
    unrelated = tmp_path / "ferrodist-not-a-segment"
    for path in (left, alive, foreign, unrelated):
        path.write_bytes(b"")
    segment = create_segment(4096, directory=str(tmp_path))
    assert segment.path is not None and segment.address.startswith("file ")
    assert os.path.basename(segment.path).startswith(f"ferrodist-abc123-{ns}-{os.getpid()}-")
    assert not left.exists() and alive.exists() and foreign.exists() and unrelated.exists()
    other = open_segment(segment.address, 4096)
    os.close(other)
    segment.release()
    assert not os.path.exists(segment.path)
    assert sweep_dead_segments(str(tmp_path)) == []
