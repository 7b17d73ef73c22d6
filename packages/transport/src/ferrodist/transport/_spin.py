"""Spin-waits on words shared between processes, compiled with Numba (no GIL, no Python
per iteration: a round trip between two processes costs well under a microsecond)."""

from __future__ import annotations

import numpy as np

from ferrodist.core.kernels import jit, load_acquire, store_release

__all__ = ["first_different", "publish", "spin_until"]


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
