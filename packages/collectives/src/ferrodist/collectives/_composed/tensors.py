"""Single-tensor collectives as torch names them: ``all_gather_into_tensor``,
``reduce_scatter_tensor`` and the rows of ``ProcessGroup.all_to_all_single`` (uneven
splits along dim 0).

The first two are functions over a group's public collectives: they check torch's two
output (input) layouts and run ``all_gather`` / ``reduce_scatter`` on the whole tensor,
so they take the same routes (the transport's own collectives on shm and mpi) and meet
a peer calling those. ``all_to_all_single`` is one call of two steps: the ranks first tell each peer how many rows they send it and
expect from it (and how long a row is), so a split that contradicts a peer's is named
on both ranks before any data moves; then the rows travel pairwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ferrodist.collectives._checks import Checker, on_group
from ferrodist.collectives._timeouts import Timeout
from ferrodist.collectives._work import Work
from ferrodist.core import ReduceOp, Tensor

if TYPE_CHECKING:
    from ferrodist.collectives._group import ProcessGroup


def layouts(part: Tensor, size: int) -> tuple[tuple[int, ...], ...]:
    """The shapes torch allows for a tensor holding ``size`` tensors shaped like ``part``:
    the concatenation along dim 0, and the stack ``(size, *part.shape)``."""
    stacked = (size, *part.shape)
    if not part.shape:
        return (stacked,)
    return ((size * part.shape[0], *part.shape[1:]), stacked)


def check_layout(check: Checker, whole: Tensor, part: Tensor, size: int, whole_name: str, part_name: str) -> None:
    if whole.dtype is not part.dtype:
        raise check.fail(f"{whole_name} is {whole.dtype.name} but {part_name} is {part.dtype.name}; use one dtype")
    allowed = layouts(part, size)
    if whole.shape not in allowed:
        forms = " or ".join(str(s) for s in allowed)
        raise check.fail(
            f"{whole_name} has shape {whole.shape}, but with {part_name} of shape {part.shape} on {size} ranks "
            f"it must be {forms} (the {part_name}s concatenated along dim 0, or stacked)"
        )


def all_gather_into_tensor(
    group: ProcessGroup, output_tensor: Any, input_tensor: Any, *, async_op: bool = False, timeout: Timeout = None
) -> Work | None:
    """Every rank's ``input_tensor`` into ``output_tensor``, in group-rank order: the
    inputs concatenated along dim 0 (``(size * n, ...)``) or stacked (``(size, n, ...)``).

    Example::

        out = np.empty((2, 3))
        all_gather_into_tensor(out, np.full(3, rank * 1.0))   # every rank: [[0, 0, 0], [1, 1, 1]]
    """
    check = on_group(group, "all_gather_into_tensor")
    part = check.tensor(input_tensor, "input_tensor")
    whole = check.tensor(output_tensor, "output_tensor", writeable=True)
    check_layout(check, whole, part, group.size, "output_tensor", "input_tensor")
    return group.all_gather(output_tensor, input_tensor, async_op=async_op, timeout=timeout)


def reduce_scatter_tensor(
    group: ProcessGroup,
    output: Any,
    input: Any,
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    async_op: bool = False,
    timeout: Timeout = None,
) -> Work | None:
    """Group rank i's ``output`` = the reduction over ranks of block i of their ``input``:
    ``input`` is the blocks concatenated along dim 0 (``(size * n, ...)``) or stacked
    (``(size, n, ...)``); it is not modified.

    Example::

        out = np.empty(1)
        reduce_scatter_tensor(out, np.array([1.0, 2.0]))   # rank 0: [2.]  rank 1: [4.]
    """
    check = on_group(group, "reduce_scatter_tensor")
    part = check.tensor(output, "output", writeable=True)
    whole = check.tensor(input, "input")
    check_layout(check, whole, part, group.size, "input", "output")
    return group.reduce_scatter(output, input, op, async_op=async_op, timeout=timeout)
