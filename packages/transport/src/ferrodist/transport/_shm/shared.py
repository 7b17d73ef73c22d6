"""Memory that every rank of a single-host group maps: each rank's buffer, readable in place
by its peers, so a collective on it moves no byte through the arena's slots.

An allocation is collective: every rank makes a segment of the same size (``segment``: an
anonymous memfd, nothing in /dev/shm), the ranks swap the segments' addresses, each maps
every peer's, and only once every rank has mapped every segment do they close their
descriptors. From then on a segment lives in the mappings alone, and goes with the last
process that maps it, however that process ends.

``Shared.find`` tells whether an array lies in one of the group's buffers, and where: the
collectives then read the same place of each peer's buffer (``peers``).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ferrodist.core import BackendUnavailable, FerrodistError

from .segment import SegmentGone, create_segment, open_segment

__all__ = ["Buffer", "Shared"]

Array = np.ndarray[Any, Any]
#: Swap one string with every rank of the group: this rank's in, every rank's out, in rank order.
Exchange = Callable[[str], list[str]]
#: Every buffer starts on a 4 KiB page, so any dtype is aligned and a buffer shares no cache
#: line with another.
PAGE = 4096


@dataclass
class Buffer:
    """One allocation: ``maps[q]`` is rank q's segment as mapped here (``maps[rank]`` is this
    rank's own) and ``bytes_of[q]`` the same as uint8; ``number`` its place in the group's
    allocations (the same on every rank)."""

    number: int
    nbytes: int
    maps: tuple[mmap.mmap, ...]
    bytes_of: tuple[Array, ...]

    def close(self) -> None:
        """Unmap what no array shows any more: the peers' segments at once, this rank's own
        once the last of the user's arrays on it is gone."""
        self.bytes_of = ()
        for view in self.maps:
            try:
                view.close()
            except BufferError:  # a user's array still shows it: it goes with that array
                pass


class Shared:
    """The buffers of one group on this rank (``rank`` of ``world``)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.buffers: list[Buffer] = []
        self._ranges: list[tuple[int, int, Buffer]] = []  # (start, end) of this rank's map

    def allocate(self, nbytes: int, exchange: Exchange) -> Array:
        """A zero-filled array of ``nbytes`` bytes (uint8) in memory every rank maps; a
        collective: every rank of the group calls it with the same size, in the same order.

        Raises ``BackendUnavailable`` on every rank if one rank cannot make or map a segment."""
        size = max(PAGE, -(-nbytes // PAGE) * PAGE)
        segment, why = None, ""
        try:
            segment = create_segment(size)
        except (OSError, FerrodistError) as exc:
            why = f"could not make it ({exc})"
        addresses = exchange("" if segment is None else segment.address)
        maps: list[mmap.mmap] = []
        try:
            if not why:
                why = self._map_all(addresses, size, maps)
            said = exchange(why)  # every rank has mapped every segment (or says why not)
        finally:
            if segment is not None:
                segment.release()
        failed = [(q, text) for q, text in enumerate(said) if text]
        if failed:
            for view in maps:
                view.close()
            q, text = failed[0]
            raise BackendUnavailable(
                f"rank {self.rank}: shared buffer of {nbytes} bytes: rank {q} {text}; "
                "allocate ordinary arrays instead (the collectives take them too)",
                rank=self.rank,
            )
        views = tuple(np.frombuffer(view, np.uint8) for view in maps)
        buffer = Buffer(len(self.buffers), nbytes, tuple(maps), views)
        self.buffers.append(buffer)
        start = views[self.rank].ctypes.data
        self._ranges.append((start, start + size, buffer))
        return views[self.rank][:nbytes]

    def _map_all(self, addresses: Sequence[str], size: int, maps: list[mmap.mmap]) -> str:
        """Map every rank's segment into ``maps``; what went wrong, in words, or ""."""
        for q, address in enumerate(addresses):
            if not address:
                return ""  # that rank says why itself
            try:
                fd = open_segment(address, size)
            except (SegmentGone, OSError, FerrodistError) as exc:
                return f"could not map rank {q}'s segment ({exc})"
            try:
                maps.append(mmap.mmap(fd, size))
            except OSError as exc:
                return f"could not map rank {q}'s segment ({exc})"
            finally:
                os.close(fd)
        return ""

    def find(self, x: Array) -> tuple[Buffer, int] | None:
        """The buffer ``x`` lies in, and its offset in bytes there; None if it lies in none
        (or is not contiguous)."""
        if not self._ranges or not x.flags.c_contiguous:
            return None
        start = x.ctypes.data
        end = start + x.nbytes
        for low, high, buffer in self._ranges:
            if low <= start and end <= high:
                return buffer, start - low
        return None

    @staticmethod
    def place(buffer: Buffer, offset: int) -> tuple[int, str]:
        """Where an array lies, as one number (the same on every rank for the same place)
        and in words."""
        return (buffer.number + 1) << 40 | offset, f"shared array #{buffer.number}, byte {offset}"

    def peers(self, x: Array, buffer: Buffer, offset: int) -> list[Array]:
        """Every rank's ``x``: the same place in each rank's buffer, seen as ``x`` (rank
        order; this rank's is ``x``'s own memory)."""
        n = x.nbytes
        return [view[offset : offset + n].view(x.dtype).reshape(x.shape) for view in buffer.bytes_of]

    def close(self) -> None:
        for buffer in self.buffers:
            buffer.close()
        self.buffers.clear()
        self._ranges.clear()
