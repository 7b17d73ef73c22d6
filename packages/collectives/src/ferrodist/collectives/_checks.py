"""Argument checks shared by the collectives: everything is validated before a byte moves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ferrodist.core import (
    DType,
    FerrodistError,
    InvalidArgument,
    InvalidRank,
    ReduceOp,
    Tensor,
    as_tensor,
    bfloat16,
    check_op,
)

from ._call import Array


class Member(Protocol):
    """What the checks ask of a group: this rank's global number, and whether it may call
    (``ProcessGroup`` is one)."""

    @property
    def global_rank(self) -> int: ...

    def member_rank(self, operation: str) -> int: ...


class Blocks(list):  # type: ignore[type-arg]
    """One flat array per rank; ``whole`` is the single array they are consecutive views of
    (when the caller passed one tensor), or ``None`` (when the caller passed a list)."""

    whole: Array | None = None

    @classmethod
    def of(cls, flat: Array, size: int) -> Blocks:
        """A flat array as ``size`` consecutive blocks (``whole`` is the array)."""
        count = flat.shape[0] // size
        blocks = cls(flat[k * count : (k + 1) * count] for k in range(size))
        blocks.whole = flat
        return blocks


class Checker:
    """Builds error messages that name the rank and the operation."""

    def __init__(self, rank: int, operation: str) -> None:
        self.rank = rank
        self.operation = operation
        self.seen: list[Tensor] = []  # every tensor checked so far (to find their device)

    def fail(self, message: str, cls: type[FerrodistError] = InvalidArgument) -> FerrodistError:
        return cls(f"rank {self.rank}: {self.operation}: {message}", rank=self.rank, operation=self.operation)

    def tensor(self, obj: object, what: str = "tensor", *, writeable: bool = False) -> Tensor:
        try:
            t = as_tensor(obj)
        except FerrodistError as exc:
            raise exc.with_context(f"rank {self.rank}: {self.operation}: {what}") from None
        if writeable and not t.writeable:
            raise self.fail(f"{what} is read-only but this rank writes its result into it; pass a writeable array")
        self.seen.append(t)
        return t

    def op(self, op: object, tensor: Tensor) -> ReduceOp:
        try:
            reduce_op = ReduceOp.coerce(op)
        except InvalidArgument as exc:
            raise exc.with_context(f"rank {self.rank}: {self.operation}") from None
        check_op(reduce_op, tensor.dtype, operation=self.operation, rank=self.rank)
        return reduce_op

    def root(self, root: object, size: int, what: str) -> int:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
            raise self.fail(f"{what} must be an integer rank, not {root!r}", InvalidRank)
        if not 0 <= int(root) < size:
            raise self.fail(f"{what}={root} is outside the group (valid: 0..{size - 1})", InvalidRank)
        return int(root)

    def blocks(self, obj: object, like: Tensor, size: int, what: str, *, writeable: bool) -> Blocks:
        """``size`` flat arrays shaped like ``like``: from a list of ``size`` tensors, or from one
        tensor of ``size * like.numel`` elements split into equal consecutive blocks."""
        if isinstance(obj, (list, tuple)):
            if len(obj) != size:
                raise self.fail(f"{what} has {len(obj)} entries but the group has {size} ranks; pass one per rank")
            tensors = [self.tensor(item, f"{what}[{i}]", writeable=writeable) for i, item in enumerate(obj)]
            for i, t in enumerate(tensors):
                self.same_kind(t, like, f"{what}[{i}]")
            return Blocks(t.flat() for t in tensors)
        whole = self.tensor(obj, what, writeable=writeable)
        if whole.dtype is not like.dtype:
            raise self.fail(f"{what} is {whole.dtype.name} but the tensor is {like.dtype.name}; use one dtype")
        if whole.numel != size * like.numel:
            raise self.fail(
                f"{what} has {whole.numel} elements; it needs group size x tensor elements = "
                f"{size} x {like.numel} = {size * like.numel} (or pass a list of {size} tensors)"
            )
        return Blocks.of(whole.flat(), size)

    def same_kind(self, t: Tensor, like: Tensor, what: str) -> None:
        if t.dtype is not like.dtype:
            raise self.fail(f"{what} is {t.dtype.name} but the tensor is {like.dtype.name}; use one dtype")
        if t.numel != like.numel:
            raise self.fail(f"{what} has {t.numel} elements but the tensor has {like.numel}; they must match")

    def absent(self, obj: object, what: str, root_name: str, root: int) -> None:
        if obj is not None:
            raise self.fail(f"{what} is only used on the {root_name} rank ({root}); pass None on the other ranks")

    def present(self, obj: object, what: str) -> Any:
        if obj is None:
            raise self.fail(f"{what} is required on this rank (it is the root); pass a list or a tensor")
        return obj

    def tensors(self, obj: object, size: int, what: str, *, writeable: bool) -> list[Tensor]:
        if isinstance(obj, (list, tuple)):
            if len(obj) != size:
                raise self.fail(f"{what} has {len(obj)} entries but the group has {size} ranks")
            return [self.tensor(item, f"{what}[{i}]", writeable=writeable) for i, item in enumerate(obj)]
        raise self.fail(f"{what} must be a list of {size} tensors, not {type(obj).__name__}")


def on_group(group: Member, operation: str) -> Checker:
    """The checks of ``operation`` on ``group``, after making sure this rank may use it
    (``member_rank`` raises for a rank outside the group or a destroyed group)."""
    group.member_rank(operation)
    return Checker(group.global_rank, operation)


def split_equally(checker: Checker, obj: object, size: int, what: str, *, writeable: bool) -> list[Tensor]:
    """One tensor split into ``size`` equal blocks, or a list of ``size`` tensors, as Tensors."""
    if isinstance(obj, (list, tuple)):
        return checker.tensors(obj, size, what, writeable=writeable)
    whole = checker.tensor(obj, what, writeable=writeable)
    if whole.numel % size:
        raise checker.fail(f"{what} has {whole.numel} elements, not divisible by the group size {size}")
    part = whole.numel // size
    flat = whole.flat()
    if whole.is_cuda:
        return [Tensor.from_device_array(flat[i * part : (i + 1) * part], dtype=whole.dtype) for i in range(size)]
    return [Tensor(flat[i * part : (i + 1) * part]) for i in range(size)]


def device_blocks(blocks: Sequence[Any], dt: DType) -> list[Tensor]:
    """Device tensors over the flat device-array ``blocks`` of a call (for a device engine)."""
    return [Tensor.from_device_array(block, dtype=dt) for block in blocks]


def wire_dtype(check: Checker, compress: str | None, t: Tensor) -> Any:
    """The dtype that travels for ``all_reduce(..., compress=...)``: the tensor's own, or bfloat16."""
    if compress is None:
        return t.dtype
    if compress != "bf16":
        raise check.fail(f"compress={compress!r} is unknown; use compress='bf16' or leave it out")
    if t.dtype.name != "float32":
        raise check.fail(f"compress='bf16' needs a float32 tensor, not {t.dtype.name}")
    return bfloat16


def subgroup_members(ranks: Sequence[int], group: Sequence[int], me: int, name: str, parent: str) -> tuple[int, ...]:
    """The global ranks of a subgroup (``ProcessGroup.subgroup``): members of the parent
    ``group`` that include this rank, ``me``; ``InvalidRank`` otherwise."""
    members = tuple(int(r) for r in ranks)
    if any(r not in group for r in members) or me not in members:
        raise InvalidRank(
            f"rank {me}: subgroup {name}: ranks {list(members)} must be members of group {parent} "
            f"(members: {list(group)}) and include this rank",
            rank=me,
            operation="subgroup",
        )
    return members
