"""Starting a rank's process: in a process group of its own (so that the launcher signals
the rank and whatever it started), killed by the kernel if the launcher dies."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable

__all__ = ["die_with", "start_rank"]

_PR_SET_PDEATHSIG = 1


def start_rank(argv: list[str], env: dict[str, str], setup: Callable[[], None] | None) -> subprocess.Popen[bytes]:
    """One rank, in its own process group, running ``setup`` (``die_with``) before exec.

    A process group, not a session: Linux shares the CPU fairly between sessions (autogroups)
    before it looks at nice values, so ranks in sessions of their own would each compete as
    equals with a busy process that a user started at nice 19. A rank reads no terminal
    (its stdin is /dev/null where the launcher's is one): outside the terminal's foreground
    group, a read would stop it."""

    def start() -> None:
        os.setpgid(0, 0)
        if setup is not None:
            setup()

    stdin = subprocess.DEVNULL if _is_terminal(0) else None
    return subprocess.Popen(
        argv, env=env, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=start
    )


def _is_terminal(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def die_with(launcher: int) -> Callable[[], None] | None:
    """What a rank runs between fork and exec so the kernel kills it with SIGKILL when the
    launcher dies (``PR_SET_PDEATHSIG``); ``None`` where the system has no such thing.

    A launcher that died between the fork and the ``prctl`` would go unnoticed, so the rank
    then checks that its parent is still the launcher."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    option, sigkill, zero = ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0)

    def die_with_launcher() -> None:
        prctl(option, sigkill, zero, zero, zero)
        if os.getppid() != launcher:
            os.kill(os.getpid(), signal.SIGKILL)

    return die_with_launcher
