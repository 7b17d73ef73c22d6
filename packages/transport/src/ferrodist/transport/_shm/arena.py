"""The shared-memory arena of a single-host job: control words and data slots.

One segment per job (see ``segment``: an anonymous memfd of rank 0, so nothing is left
behind whenever a rank is killed), made by rank 0 and mapped by every rank. Layout:

    control   world x 8 counters, each alone on a 64-byte line (no false sharing);
              next to each counter, the "sleeping" flag of its owner; the CALL and
              CALL_NUMBER lines hold, per slot, the identity of the call whose chunk is
              in that slot (its fingerprint, and its number on the group plus one); the
              PLACE line, where an in-place call's array lies in the group's shared
              buffers
    data      world x slots x chunk bytes: rank r's slot s at r*slots + s

A slot holds, unless told otherwise, half a core's L2 cache (``default_chunk``), so that a
chunk, the slots it meets and the peers' parts stay in that cache while they are folded.

Ranks advance monotonic counters ("I have copied chunk g in", "I have reduced it", ...)
and wait for each other's: spinning for up to about 100 us while the machine has a core
for every runnable thread (briefly when it does not), then sleeping on a futex, so
waiting costs no CPU. A waiter wakes at least every few milliseconds to check its
deadline and whether a peer's connection broke.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ferrodist.core import CollectiveMismatch, CollectiveTimeout, FerrodistError, PeerLost
from ferrodist.transport._cores import SpinPolicy, yields_for

from . import futex
from .spin import first_different, publish, spin_then_yield, spin_until

__all__ = ["DEFAULT_CHUNK", "DEFAULT_SLOTS", "Arena", "default_chunk"]

LINE = 64
COUNTERS = 8
COPIED, REDUCED, GATHERED, BARRIER, CALL, CALL_NUMBER, PLACE = range(7)
_WORDS_PER_LINE = LINE // 8
_NAP = 0.001  # the longest sleep between checks of the deadline and of peers' health
_YIELD_BATCH = 16  # core give-aways between two checks of the deadline and of peers' health
DEFAULT_CHUNK = 1 << 20  # bytes per slot where a core's L2 cache size cannot be read
DEFAULT_SLOTS = 2
_L2 = "/sys/devices/system/cpu/cpu0/cache/index2"


def default_chunk(cache: str = _L2) -> int:
    """Bytes per slot: half a core's L2 cache, from 256 KiB to 1 MiB (so that a chunk of
    ``x``, the slots it meets and the peers' parts stay in the core's L2 while they are
    folded); ``DEFAULT_CHUNK`` where Linux does not say the cache's size."""
    try:
        with open(os.path.join(cache, "level")) as level, open(os.path.join(cache, "size")) as size:
            if level.read().strip() != "2":
                return DEFAULT_CHUNK
            text = size.read().strip().upper()
        units = {"K": 1 << 10, "M": 1 << 20}
        l2 = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
    except (OSError, ValueError):
        return DEFAULT_CHUNK
    return min(1 << 20, max(256 << 10, l2 // 2 // 64 * 64))


class Arena:
    """A mapped arena; ``slot(r, s)`` is a view of rank r's data slot s."""

    def __init__(self, mapping: mmap.mmap, rank: int, world: int, chunk: int, slots: int) -> None:
        self._map = mapping
        self.rank = rank
        self.world = world
        self.chunk = chunk
        self.slots = slots
        control = world * COUNTERS * LINE
        self._words = np.frombuffer(mapping, np.uint64, count=control // 8)
        self._lines = self._words.reshape(world, COUNTERS, LINE // 8)  # [rank, counter, word]
        self.share_host(world)
        self._data = np.frombuffer(mapping, np.uint8, offset=control, count=world * slots * chunk)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        self.chunks = 0  # chunks this rank has gone through (the same sequence on every rank)

    def share_host(self, ranks: int) -> None:
        """How this rank waits, for ``ranks`` ranks of the job on this host (the arena's own,
        or more where nodes of one job share a host): spin long while every runnable thread
        has a core, briefly when threads queue for cores (measured: ``SpinPolicy``); where
        the ranks alone outnumber the cores, also give the core away (``sched_yield``) up to
        100 times before sleeping, as the rank that is late is most likely waiting for it.
        ``FERRODIST_SHM_SPINS`` and ``FERRODIST_SHM_YIELDS`` fix either."""
        self._policy = SpinPolicy(ranks, int(os.environ.get("FERRODIST_SHM_SPINS", 0)))
        self._yields = int(os.environ.get("FERRODIST_SHM_YIELDS", yields_for(ranks)))

    @property
    def yields(self) -> int:
        """How many times a wait gives the core away before it sleeps (see ``share_host``)."""
        return self._yields

    @staticmethod
    def size(world: int, chunk: int, slots: int) -> int:
        return world * COUNTERS * LINE + world * slots * chunk

    @classmethod
    def create(cls, fd: int, rank: int, world: int, chunk: int, slots: int) -> Arena:
        """Map the new, zero-filled segment ``fd`` (rank 0; the caller keeps ``fd``)."""
        if os.fstat(fd).st_size != cls.size(world, chunk, slots):
            os.ftruncate(fd, cls.size(world, chunk, slots))
        return cls.attach(fd, rank, world, chunk, slots)

    @classmethod
    def attach(cls, fd: int, rank: int, world: int, chunk: int, slots: int) -> Arena:
        """Map the segment ``fd`` that rank 0 made (the caller keeps ``fd``)."""
        mapping = mmap.mmap(fd, cls.size(world, chunk, slots))
        return cls(mapping, rank, world, chunk, slots)

    def close(self) -> None:
        self._lines = None  # type: ignore[assignment]
        self._data = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere: the mapping goes when it does

    # -- data ------------------------------------------------------------------------------------
    @property
    def data(self) -> np.ndarray[Any, Any]:
        """Every rank's slots, as bytes (rank r's slot s at ``(r * slots + s) * chunk``)."""
        return self._data

    @property
    def words(self) -> np.ndarray[Any, Any]:
        """The control words (see the module docstring), for compiled loops."""
        return self._words

    @property
    def spins(self) -> int:
        """How long a wait of a transfer of many chunks that starts now spins before it
        sleeps (see ``SpinPolicy``)."""
        return self._policy.spins(bulk=True)

    @property
    def small_spins(self) -> int:
        """How long a wait of a call of one chunk or less spins before it sleeps."""
        return self._policy.spins()

    def slot(self, rank: int, index: int, dtype: np.dtype[Any], count: int) -> np.ndarray[Any, Any]:
        start = (rank * self.slots + index) * self.chunk
        return self._data[start : start + count * dtype.itemsize].view(dtype)

    # -- synchronisation -----------------------------------------------------------------------
    def counter(self, rank: int, which: int) -> int:
        return int(self._lines[rank, which, 0])

    def advance(self, which: int, value: int) -> None:
        """Publish this rank's counter and wake anyone sleeping on counters of this kind."""
        index = (self.rank * COUNTERS + which) * _WORDS_PER_LINE
        if publish(self._words, index, value, COUNTERS * _WORDS_PER_LINE, which * _WORDS_PER_LINE + 1, self.world):
            futex.wake(self._base + index * 8)

    def wake(self, which: int) -> None:
        """Wake ranks asleep on this rank's counter ``which`` (after a compiled loop published it)."""
        futex.wake(self._base + (self.rank * COUNTERS + which) * LINE)

    def publish_call(self, slot: int, fingerprint: int, seq: int) -> None:
        """Say which call the chunk in ``slot`` belongs to (before publishing that chunk):
        its fingerprint and its number ``seq`` on the group."""
        self._lines[self.rank, CALL_NUMBER, 2 + slot] = seq + 1
        self._lines[self.rank, CALL, 2 + slot] = fingerprint

    def publish_place(self, slot: int, place: int) -> None:
        """Say where the array of an in-place call lies (``Shared.place``), with its chunk."""
        self._lines[self.rank, PLACE, 2 + slot] = place

    def check_place(self, slot: int, place: int, where: str) -> None:
        """After every rank's chunk in ``slot`` is there: raise if a rank's array lies at
        another place of the shared buffers than this rank's (``where``, in words)."""
        theirs = self._lines[:, PLACE, 2 + slot]
        peer = next((q for q in range(self.world) if int(theirs[q]) != place), -1)
        if peer >= 0:
            raise CollectiveMismatch(
                f"rank {self.rank}: rank {peer}'s array lies at another place of the group's shared memory than "
                f"this rank's ({where}): pass the same part of the same shared_zeros array on every rank",
                rank=self.rank,
                peer=peer,
            )

    def check_call(self, ranks: range | list[int], slot: int, fingerprint: int, seq: int) -> None:
        """After waiting for ``ranks``' chunk in ``slot``: raise if one of them is in another call
        (another kind of call, or the same kind with another number: the ranks are out of step).

        A slot's identity cannot be overwritten before every rank is done with its chunk,
        so what is read here is the peer's call for this very chunk.
        """
        stride, first, stop = COUNTERS * _WORDS_PER_LINE, ranks[0], ranks[-1] + 1
        peer = -1
        if fingerprint:
            signed = fingerprint - (1 << 64) if fingerprint >= 1 << 63 else fingerprint  # the 64 bits, as int64
            peer = first_different(self._words, stride, CALL * _WORDS_PER_LINE + 2 + slot, first, stop, signed)
        if peer >= 0:
            raise CollectiveMismatch(
                f"rank {self.rank}: rank {peer} is in another call than this rank",
                rank=self.rank,
                peer=peer,
                expected=fingerprint,
                received=int(self._lines[peer, CALL, 2 + slot]),
            )
        peer = first_different(self._words, stride, CALL_NUMBER * _WORDS_PER_LINE + 2 + slot, first, stop, seq + 1)
        if peer >= 0:
            theirs = int(self._lines[peer, CALL_NUMBER, 2 + slot]) - 1
            raise CollectiveMismatch(
                f"rank {self.rank}: rank {peer} is in call #{theirs} of the group while this rank is in call "
                f"#{seq}: the ranks are out of step",
                rank=self.rank,
                peer=peer,
                expected=fingerprint,
            )

    def wait(
        self,
        which: int,
        target: int,
        deadline: float,
        health: Callable[[], None],
        ranks: range | list[int] | None = None,
        bulk: bool = False,
    ) -> None:
        """Block until the counter ``which`` of every rank in ``ranks`` (default: all) reaches ``target``.

        ``ranks``: all ranks, or a list of one rank. ``bulk``: the wait is one of a transfer
        of many chunks (see ``SpinPolicy.spins``).
        """
        first, stop = (0, self.world) if ranks is None else (ranks[0], ranks[-1] + 1)
        stride, offset = COUNTERS * _WORDS_PER_LINE, which * _WORDS_PER_LINE
        yielded = 0
        while True:
            # Where ranks share cores, the wait gives the core away between spins, in compiled
            # batches (a health check and the deadline between them) before it sleeps.
            batch = min(_YIELD_BATCH, self._yields - yielded)
            words, spins = self._words, self._policy.spins(bulk)
            laggard = spin_then_yield(words, stride, offset, first, stop, target, spins, batch)
            if laggard < 0:
                return
            yielded += batch
            left = deadline - time.monotonic()
            if left <= 0:
                column = self._lines[:, which, 0]
                late = [peer for peer in range(first, stop) if column[peer] < target]
                raise CollectiveTimeout(
                    f"rank {self.rank}: timed out in shared memory waiting for ranks {late}, which had not got "
                    "there by the call's deadline (raise the timeout if they are only slow)",
                    rank=self.rank,
                    waiting_for=tuple(late),
                )
            try:
                health()
            except PeerLost:
                # A peer that published what this wait needs and then left (it finished, or
                # died) is lost only for what comes later: its part of this chunk is in shared
                # memory. Seen when this thread was slow to get the GIL back after the spin.
                if spin_until(self._words, stride, offset, first, stop, target, 1) < 0:
                    return
                raise
            if yielded < self._yields:  # ranks share cores: let the laggard run
                continue
            column = self._lines[:, which, 0]
            seen = int(column[laggard])
            self._lines[self.rank, which, 1] = 1  # "I may sleep": wakers check this flag
            if int(column[laggard]) == seen and seen < target:
                futex.wait(self._base + (laggard * COUNTERS + which) * LINE, seen, min(left, _NAP))
            self._lines[self.rank, which, 1] = 0


def check_health(lost: dict[int, FerrodistError], context: str) -> Callable[[], None]:
    """A health check for waits: raise the first recorded peer failure."""

    def health() -> None:
        for error in list(lost.values()):
            raise error.with_context(context)

    return health
