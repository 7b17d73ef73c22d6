"""The other call forms of torch's ``ProcessGroup`` methods, as options objects.

Besides ``method(tensors, opts)``, torch's bindings accept short forms that some torch
code uses (DDP's ``process_group.allreduce(tensor)``): ``allreduce(tensor, op, timeout)``,
``broadcast(tensor, root, timeout)``, ``reduce(tensor, root, op, timeout)``, ... Each
helper here turns the arguments after the tensors into the options object of the long form.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ferrodist.core import InvalidArgument


def _timeout(opts: Any, timeout: Any) -> Any:
    if timeout is None:
        return opts
    if not isinstance(timeout, timedelta):
        raise InvalidArgument(f"timeout must be a datetime.timedelta, not {timeout!r}")
    opts.timeout = timeout
    return opts


def plain_options(kind: type, opts: Any) -> Any:
    """``opts`` (an options object, a timeout, or ``None``) as a ``kind``."""
    if isinstance(opts, kind):
        return opts
    return _timeout(kind(), opts)


def reduce_options(kind: type, opts: Any, timeout: Any) -> Any:
    """``opts`` (an options object, a ``ReduceOp``, or ``None``) and ``timeout`` as a ``kind``."""
    if isinstance(opts, kind):
        return opts
    built = kind()
    if opts is not None:
        built.reduceOp = _reduce_op(opts)
    return _timeout(built, timeout)


def rooted_options(kind: type, opts: Any, timeout: Any, op: Any = None) -> Any:
    """``opts`` (an options object, a root rank, or ``None``), ``op`` and ``timeout`` as a ``kind``."""
    if isinstance(opts, kind):
        return opts
    built = kind()
    if opts is not None:
        if isinstance(opts, bool) or not isinstance(opts, int):
            raise InvalidArgument(f"{kind.__name__}: expected options or a root rank, not {opts!r}")
        built.rootRank = opts
    if op is not None:
        built.reduceOp = _reduce_op(op)
    return _timeout(built, timeout)


def _reduce_op(op: Any) -> Any:
    if isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        return op
    raise InvalidArgument(f"expected a torch.distributed.ReduceOp, not {op!r}")
