"""The memory behind a single-host job's arena: an anonymous memfd of rank 0, or a named file.

Rank 0 makes the segment with ``memfd_create``: it has no name anywhere (nothing appears
in ``/dev/shm``), and the kernel frees it when the last process holding it exits, however
and whenever that process is killed. Rank 0 keeps its descriptor open until every rank has
mapped the segment, and publishes an *address* in the store: its pid, the descriptor's
number and the segment's inode. The other ranks (on the same host: the caller checks) open
``/proc/<pid>/fd/<fd>``, and refuse what they opened if its inode differs (rank 0 died and
its pid now belongs to another process).

Where ``memfd_create`` is missing, or ``FERRODIST_SHM_MEMFD=0`` says not to use it, the
segment is a file ``/dev/shm/ferrodist-<job>-<pidns>-<pid>-<random>`` that rank 0 unlinks
as soon as every rank has it mapped. A kill before that leaves the file behind, so whoever
makes the next named segment on this host first removes the files whose creator (the pid
in the name, in the same PID namespace) is no longer running; ``ferrodist run`` also
removes its job's files when it ends.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import re
import secrets
from dataclasses import dataclass

from ferrodist.core import BackendUnavailable, InvalidArgument

__all__ = ["Segment", "SegmentGone", "create_segment", "open_segment", "sweep_dead_segments"]

SHM_DIR = "/dev/shm"
PREFIX = "ferrodist-"
#: ferrodist-<job>-<creator's PID namespace>-<creator's pid>-<random>; the job is the
#: launcher's FERRODIST_JOB_ID
_NAMED = re.compile(r"^ferrodist-[0-9A-Za-z]+-(\d+)-(\d+)-[0-9a-f]+$")


class SegmentGone(Exception):
    """The segment's creator no longer holds it (``open_segment``); the caller names the rank."""


@dataclass(frozen=True)
class Segment:
    """A segment rank 0 made: ``fd`` (owned by this object until ``release``), the
    ``address`` the other ranks open it by, and the file to unlink, if it has a name."""

    fd: int
    address: str
    path: str | None = None

    def release(self) -> None:
        """Close the descriptor and remove the name: from now on the segment lives only in
        the mappings, and goes with the last of them."""
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self.fd)


def job_id() -> str:
    """The launcher's job id (a named segment carries it, so ``ferrodist run`` can sweep it)."""
    job = os.environ.get("FERRODIST_JOB_ID", "")
    return job if job.isalnum() else secrets.token_hex(6)


def create_segment(size: int, *, directory: str = SHM_DIR) -> Segment:
    """A new zero-filled segment of ``size`` bytes: a memfd where the system has one, else a
    named file in ``directory`` (after removing the files of creators that are gone)."""
    if os.environ.get("FERRODIST_SHM_MEMFD", "1") != "0" and hasattr(os, "memfd_create"):
        try:
            fd = os.memfd_create(f"ferrodist-{secrets.token_hex(4)}", os.MFD_CLOEXEC)
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EPERM, errno.EINVAL):  # else: no memfd here
                raise BackendUnavailable(f"shared memory: memfd_create failed ({exc.strerror})") from None
        else:
            try:
                os.ftruncate(fd, size)
                address = f"memfd {os.getpid()} {fd} {os.fstat(fd).st_ino}"
            except BaseException:
                os.close(fd)
                raise
            return Segment(fd, address)
    sweep_dead_segments(directory)
    path = os.path.join(directory, f"{PREFIX}{job_id()}-{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise BackendUnavailable(
            f"shared memory: cannot create {path} ({exc.strerror}); is {directory} mounted and writable? "
            "Else use backend='tcp'"
        ) from None
    try:
        os.ftruncate(fd, size)
        address = f"file {os.fstat(fd).st_ino} {path}"
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return Segment(fd, address, path)


def open_segment(address: str, size: int) -> int:
    """Open the segment at ``address`` (from ``Segment.address``) for reading and writing.

    Raises:
        SegmentGone: the creator no longer holds it (it exited, or gave up waiting).
        BackendUnavailable: it exists but this process may not open it.
        InvalidArgument: its size is not ``size`` (the ranks sized the arena differently).
    """
    kind, _, rest = address.partition(" ")
    if kind == "memfd":
        pid, fd, inode = (int(part) for part in rest.split())
        path = f"/proc/{pid}/fd/{fd}"
    elif kind == "file":
        inode_text, _, path = rest.partition(" ")
        inode = int(inode_text)
    else:
        raise InvalidArgument(f"shared memory: {address!r} is not a segment address")
    try:
        opened = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SegmentGone(f"{path} no longer exists") from None
    except PermissionError:
        raise BackendUnavailable(
            f"shared memory: this process may not open {path} (ranks of one job run as different users, "
            "or /proc is restricted); set FERRODIST_SHM_MEMFD=0 on rank 0 to use a file in /dev/shm, "
            "or use backend='tcp'"
        ) from None
    try:
        found = os.fstat(opened)
        if found.st_ino != inode:
            raise SegmentGone(f"{path} is now another file (its process is gone and the pid was reused)")
        if found.st_size != size:
            raise InvalidArgument(
                f"shared memory: rank 0 made an arena of {found.st_size} bytes but this rank needs {size}: "
                "set the same FERRODIST_SHM_CHUNK and FERRODIST_SHM_SLOTS for every rank"
            )
    except BaseException:
        os.close(opened)
        raise
    return opened


def sweep_dead_segments(directory: str = SHM_DIR) -> list[str]:
    """Remove the named segments in ``directory`` whose creator is no longer running (a rank
    0 killed before it unlinked its file). Returns what was removed."""
    removed, namespace = [], _pid_namespace()
    for path in glob.glob(os.path.join(directory, f"{PREFIX}*")):
        match = _NAMED.match(os.path.basename(path))
        if match is None or int(match.group(1)) != namespace or _running(int(match.group(2))):
            continue
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.unlink(path)
            removed.append(path)
    return removed


def _pid_namespace() -> int:
    """The inode of this process's PID namespace (0 where /proc does not say): a pid means
    the same process only within one namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _running(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
