"""The *group* protocol: what DDP and the pipeline need from a process group.

It lives in core so that a CPU ``ProcessGroup`` and a GPU/NCCL group are
interchangeable for everything built on top of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from ._ops import ReduceOp

__all__ = ["Group", "Work"]


@runtime_checkable
class Work(Protocol):
    """A handle on an operation started with ``async_op=True``."""

    def wait(self, timeout: float | None = None) -> None:
        """Block until the operation is done; re-raise its error if it failed."""
        ...

    def is_completed(self) -> bool:
        """True once the operation has finished, successfully or not."""
        ...


@runtime_checkable
class Group(Protocol):
    """A set of ranks that run collectives together. Ranks here are group ranks (0 .. size-1)."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def global_rank(self) -> int:
        """This rank's rank in the whole job (what error messages and traces name)."""
        ...

    def abort(self, error: BaseException) -> None:
        """Fail the group on every member because of ``error``, raised by code that drives it
        (a pipeline stage): pending and later operations raise at once instead of waiting for
        their deadlines. The group is unusable afterwards."""
        ...

    def all_reduce(
        self,
        tensor: Any,
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | None = None,
        compress: str | None = None,
    ) -> Work | None:
        """``compress="bf16"``: a float32 tensor sent and reduced as bfloat16, the result
        widened back; a group that cannot raises ``InvalidArgument``."""
        ...

    def broadcast(
        self, tensor: Any, src: int = 0, *, async_op: bool = False, timeout: float | None = None
    ) -> Work | None: ...

    def reduce(
        self,
        tensor: Any,
        dst: int = 0,
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work | None: ...

    def all_gather(
        self, output: Any, tensor: Any, *, async_op: bool = False, timeout: float | None = None
    ) -> Work | None: ...

    def reduce_scatter(
        self,
        output: Any,
        input: Any,
        op: ReduceOp = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work | None: ...

    def gather(
        self,
        tensor: Any,
        gather_list: Any = None,
        dst: int = 0,
        *,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work | None: ...

    def scatter(
        self,
        tensor: Any,
        scatter_list: Any = None,
        src: int = 0,
        *,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work | None: ...

    def all_to_all(
        self, outputs: Sequence[Any], inputs: Sequence[Any], *, async_op: bool = False, timeout: float | None = None
    ) -> Work | None: ...

    def barrier(self, *, async_op: bool = False, timeout: float | None = None) -> Work | None: ...

    def send(self, tensor: Any, dst: int, tag: int = 0, *, timeout: float | None = None) -> None: ...

    def recv(self, tensor: Any, src: int | None, tag: int = 0, *, timeout: float | None = None) -> int: ...

    def isend(self, tensor: Any, dst: int, tag: int = 0) -> Work: ...

    def irecv(self, tensor: Any, src: int | None, tag: int = 0) -> Work: ...
