"""Blocking waits on a word of shared memory (Linux futex), through ctypes.

A waiter sleeps in the kernel until another process changes the word and wakes it, or
its timeout passes: it uses no CPU while it waits, so many ranks can share few cores.
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["available", "wait", "wake"]

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # without FUTEX_PRIVATE_FLAG: works across processes


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None
if _libc is not None:
    _libc.syscall.restype = ctypes.c_long


def available() -> bool:
    return _libc is not None and _SYS_FUTEX is not None


def wait(address: int, expected: int, timeout: float) -> None:
    """Sleep while the 32-bit word at ``address`` equals ``expected`` (at most ``timeout`` s).

    Returns on a wake, a change, a timeout or a signal: callers re-check their condition.
    """
    seconds = max(0.0, timeout)
    spec = _Timespec(int(seconds), int((seconds % 1.0) * 1e9))
    assert _libc is not None and _SYS_FUTEX is not None
    _libc.syscall(
        _SYS_FUTEX,
        ctypes.c_void_p(address),
        _FUTEX_WAIT,
        ctypes.c_uint32(expected & 0xFFFFFFFF),
        ctypes.byref(spec),
        None,
        0,
    )


def wake(address: int) -> None:
    """Wake every process sleeping on the word at ``address``."""
    assert _libc is not None and _SYS_FUTEX is not None
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)
