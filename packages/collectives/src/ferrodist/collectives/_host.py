"""A group's CPU collectives, for a device engine that stages device memory through the host.

A device engine (``ferrodist.gpu``) copies a CUDA tensor, whole or one segment at a time,
into pinned host buffers and runs the group's CPU collective on them, the same route a
numpy array of that size would take (the transport's own collectives where they apply,
else our ring, doubling and tree algorithms). It runs inside the call the group already
started for the device tensor: one call number, one deadline, one tag. Each *part* (a
segment) carries the call's fingerprint with the part's element count, so ranks that cut
a tensor into different segments raise ``CollectiveMismatch`` instead of combining
unrelated bytes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ferrodist.core import DType, ReduceOp, reducer

from . import _doubling, _native, _ring, _tree
from ._call import Array, Call
from ._checks import Blocks
from ._fingerprint import COUNT_MASK
from ._select import all_reduce_algorithm

__all__ = ["BoundHost", "HostCollectives"]


class HostCollectives:
    """The CPU route of one group's collectives, on host arrays, within a running call.

    Every method takes the running ``call`` and flat host arrays of one part, and gives
    the result the group's CPU collective gives (every rank the same bits).
    """

    def __init__(self, native: Any) -> None:
        self._native = native  # the transport's own collectives for this group, or None

    @staticmethod
    def part(call: Call, count: int) -> Call:
        """``call`` with the fingerprint of a part of ``count`` elements."""
        fp = (call.fingerprint & ~COUNT_MASK) | (count & COUNT_MASK)
        return call if fp == call.fingerprint else dataclasses.replace(call, fingerprint=fp)

    def _takes(self, dt: DType, op: ReduceOp | None, nbytes: int = 0) -> Any:
        native = self._native
        if native is None or not native.supports(dt, op):
            return None
        return native if op is None or nbytes <= native.all_reduce_up_to else None

    def all_reduce(self, call: Call, x: Array, dt: DType, op: ReduceOp) -> None:
        """Reduce ``x`` in place across the group."""
        call = self.part(call, x.shape[0])
        if call.size == 1:
            return
        native = self._takes(dt, op, x.nbytes)
        if native is not None:
            native.all_reduce(x, dt, op, call.deadline, call.fingerprint, call.seq)
            return
        divisor = float(call.size) if op is ReduceOp.AVG else 1.0
        name = all_reduce_algorithm(x.nbytes, call.size, None, rank=call.ranks[call.rank])
        engine = _ring.all_reduce if name == "ring" else _doubling.all_reduce
        engine(call, x, reducer(dt, op), divisor)

    def broadcast(self, call: Call, x: Array, root: int, dt: DType) -> None:
        """Copy group rank ``root``'s ``x`` into every rank's ``x``."""
        call = self.part(call, x.shape[0])
        native = self._takes(dt, None)
        if native is not None:
            native.broadcast(x, root, dt, call.deadline, call.fingerprint, call.seq)
        else:
            _tree.broadcast(call, x, root)

    def reduce(self, call: Call, x: Array, root: int, dt: DType, op: ReduceOp) -> None:
        """Reduce into group rank ``root``'s ``x``; other ranks' ``x`` may be overwritten."""
        call = self.part(call, x.shape[0])
        native = self._takes(dt, op)
        if native is not None:
            native.reduce(x, root, dt, op, call.deadline, call.fingerprint, call.seq)
            return
        divisor = float(call.size) if op is ReduceOp.AVG else 1.0
        _tree.reduce(call, x, root, reducer(dt, op), divisor)

    def all_gather(self, call: Call, x: Array, out: Array, dt: DType) -> None:
        """``out`` (``size * len(x)`` elements, rank-major) = every rank's ``x``."""
        call = self.part(call, x.shape[0])
        blocks = _whole(out, call.size)
        native = self._takes(dt, None)
        if native is not None:
            _native.all_gather(native, call, x, blocks, dt)
            return
        blocks[call.rank][...] = x
        _ring.all_gather(call, blocks)

    def reduce_scatter(self, call: Call, out: Array, inp: Array, dt: DType, op: ReduceOp) -> None:
        """``out`` = reduction over ranks of their block ``rank`` of ``inp`` (``size`` blocks)."""
        call = self.part(call, out.shape[0])
        blocks = _whole(inp, call.size)
        if call.size == 1:
            out[...] = inp
            return
        native = self._takes(dt, op)
        if native is not None:
            _native.reduce_scatter(native, call, out, blocks, dt, op)
            return
        divisor = float(call.size) if op is ReduceOp.AVG else 1.0
        _ring.reduce_scatter(call, out, blocks, reducer(dt, op), divisor)


class BoundHost:
    """:class:`HostCollectives` bound to one running call: the ``HostRoute`` a device engine
    is handed (``ferrodist.transport.HostRoute``)."""

    __slots__ = ("_call", "_host")

    def __init__(self, host: HostCollectives, call: Call) -> None:
        self._host, self._call = host, call

    def all_reduce(self, x: Array, dt: DType, op: ReduceOp) -> None:
        self._host.all_reduce(self._call, x, dt, op)

    def broadcast(self, x: Array, root: int, dt: DType) -> None:
        self._host.broadcast(self._call, x, root, dt)

    def reduce(self, x: Array, root: int, dt: DType, op: ReduceOp) -> None:
        self._host.reduce(self._call, x, root, dt, op)

    def all_gather(self, x: Array, out: Array, dt: DType) -> None:
        self._host.all_gather(self._call, x, out, dt)

    def reduce_scatter(self, out: Array, inp: Array, dt: DType, op: ReduceOp) -> None:
        self._host.reduce_scatter(self._call, out, inp, dt, op)


def _whole(array: Array, size: int) -> Blocks:
    """``array`` as ``size`` consecutive blocks."""
    count = array.shape[0] // size
    blocks = Blocks(array[k * count : (k + 1) * count] for k in range(size))
    blocks.whole = array
    return blocks


if TYPE_CHECKING:  # what device engines are handed satisfies transport's protocols (checked by mypy)
    from ferrodist.transport import EngineCall, HostRoute

    _host_check: type[HostRoute] = BoundHost
    _call_check: type[EngineCall] = Call
