"""Collectives handed to a transport's own implementation (MPI's, shared memory's), with our bookkeeping:
blocks passed as separate tensors are packed into one scratch buffer and back."""

from __future__ import annotations

from ferrodist.collectives._call import Array, Call
from ferrodist.collectives._checks import Blocks
from ferrodist.core import DType, ReduceOp
from ferrodist.transport import NativeCollectives

#: Scratch slots used here (the algorithms in ring, tree and doubling use 0..2).
_PACK = 7


def packed(call: Call, blocks: Blocks, fill: bool) -> Array:
    """The blocks as one contiguous array: the caller's own when they passed one tensor,
    else a scratch buffer (filled with the blocks' contents when ``fill``)."""
    if blocks.whole is not None:
        return blocks.whole
    count = blocks[0].shape[0]
    buf = call.scratch.get(_PACK, count * len(blocks), blocks[0].dtype)
    if fill:
        for i, block in enumerate(blocks):
            buf[i * count : (i + 1) * count] = block
    return buf


def unpack(buf: Array, blocks: Blocks) -> None:
    if blocks.whole is None:
        count = blocks[0].shape[0]
        for i, block in enumerate(blocks):
            block[...] = buf[i * count : (i + 1) * count]


def all_gather(native: NativeCollectives, call: Call, x: Array, blocks: Blocks, dt: DType) -> None:
    out = packed(call, blocks, fill=False)
    native.all_gather(x, out, dt, call.deadline, call.fingerprint, call.seq)
    unpack(out, blocks)


def reduce_scatter(native: NativeCollectives, call: Call, out: Array, blocks: Blocks, dt: DType, op: ReduceOp) -> None:
    native.reduce_scatter(packed(call, blocks, fill=True), out, dt, op, call.deadline, call.fingerprint, call.seq)


def gather(native: NativeCollectives, call: Call, x: Array, blocks: Blocks | None, root: int, dt: DType) -> None:
    out = packed(call, blocks, fill=False) if blocks is not None else None
    native.gather(x, out, root, dt, call.deadline, call.fingerprint, call.seq)
    if blocks is not None and out is not None:
        unpack(out, blocks)


def scatter(native: NativeCollectives, call: Call, x: Array, blocks: Blocks | None, root: int, dt: DType) -> None:
    source = packed(call, blocks, fill=True) if blocks is not None else None
    native.scatter(source, x, root, dt, call.deadline, call.fingerprint, call.seq)
