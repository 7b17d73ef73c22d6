"""Spin-waits on words shared between processes, compiled with Numba (no GIL, no Python
per iteration: a round trip between two processes costs well under a microsecond).

They have no interpreted twin (their atomic loads and stores need compiled code), so a
shared-memory transport compiles them while its ranks meet (:func:`prepare_waits`), before
any collective's deadline starts. How long they spin and how often they give the core away
is ``ferrodist.transport._cores``' policy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ferrodist.core.kernels import Ticket, background, jit, load_acquire, prepare, store_release
from ferrodist.transport._libc import sys_yield

__all__ = ["first_different", "prepare_waits", "publish", "spin_then_yield", "spin_until", "wait_kernels"]


@jit
def spin_until(words, stride, offset, first, stop, target, spins):  # type: ignore[no-untyped-def]
    """Spin until ``words[r * stride + offset] >= target`` for every r in ``first..stop-1``.

    Returns -1 when they all got there, or (after ``spins`` rounds) the first rank that has not.
    """
    goal = np.uint64(max(target, 0))  # compare as uint64: a mixed comparison would go through float64
    for _ in range(spins):
        laggard = -1
        for r in range(first, stop):
            if load_acquire(words, r * stride + offset) < goal:
                laggard = r
                break
        if laggard < 0:
            return -1
    for r in range(first, stop):
        if load_acquire(words, r * stride + offset) < goal:
            return r
    return -1


@jit
def publish(words, index, value, stride, flag, world):  # type: ignore[no-untyped-def]
    """Store ``value`` at ``words[index]`` (release); True if any rank's ``flag`` word is set
    (someone may be asleep and need a wake-up)."""
    store_release(words, index, value)
    for r in range(world):
        if load_acquire(words, r * stride + flag) != 0:
            return True
    return False


@jit
def first_different(words, stride, offset, first, stop, value):  # type: ignore[no-untyped-def]
    """The first rank in ``first..stop-1`` whose word at ``offset`` is neither 0 nor ``value``, or -1."""
    expected = np.uint64(value)  # fingerprints use all 64 bits: never compare them as floats
    for r in range(first, stop):
        word = load_acquire(words, r * stride + offset)
        if word != np.uint64(0) and word != expected:
            return r
    return -1


@jit
def spin_then_yield(words, stride, offset, first, stop, target, spins, yields):  # type: ignore[no-untyped-def]
    """``spin_until``, and while a rank has not got there, up to ``yields`` times: give the
    core away (``sched_yield``) and spin again. Returns -1 or the first rank not there."""
    laggard = spin_until(words, stride, offset, first, stop, target, spins)
    while laggard >= 0 and yields > 0:
        yields -= 1
        sys_yield()
        laggard = spin_until(words, stride, offset, first, stop, target, spins)
    return laggard


def wait_kernels() -> list[tuple[Any, tuple[Any, ...]]]:
    """The four functions with the argument types ``Arena`` passes (its control words and
    Python ints), as ``prepare`` and ``warm`` take them."""
    from numba import types

    words, i = types.Array(types.uint64, 1, "C"), types.int64
    return [
        (background(spin_until), (words, i, i, i, i, i, i)),
        (background(spin_then_yield), (words, i, i, i, i, i, i, i)),
        (background(publish), (words, i, i, i, i, i)),
        (background(first_different), (words, i, i, i, i, i)),
    ]


def prepare_waits() -> Ticket:
    """Queue the compile (or the load from the cache) of :func:`wait_kernels`: code a
    transport's start waits for (it has no interpreted twin)."""
    return prepare(wait_kernels(), always=True)
