"""Checkpoints: rank 0 writes atomically, every rank loads, every rank learns if it failed."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from ferrodist.collectives import default_group
from ferrodist.core import FerrodistError, Group, ReduceOp

from ._ddp import DistributedDataParallel
from ._models import Model, adapt

__all__ = ["CheckpointError", "load_checkpoint", "resume_checkpoint", "save_checkpoint"]


class CheckpointError(FerrodistError, OSError):
    """A checkpoint could not be written or read (on this rank or another)."""


def _unwrap(module: Any) -> Any:
    return module.module if isinstance(module, DistributedDataParallel) else module


def _agree(group: Group, model: Model, failed: bool) -> int:
    """How many ranks failed (every rank learns the same number)."""
    flag = model.small(np.array([int(failed)], dtype=np.int64))
    group.all_reduce(flag, ReduceOp.SUM)
    return int(model.numpy(flag)[0])


def save_checkpoint(
    path: str | os.PathLike[str],
    module: Any,
    optimizer: Any = None,
    *,
    extra: Any = None,
    group: Group | None = None,
    root: int = 0,
) -> None:
    """Write the module's and optimizer's state to ``path`` from rank ``root`` (a collective).

    The file appears whole or not at all: written to a temporary file beside ``path``,
    flushed to disk, then renamed over it. PyTorch modules are written with ``torch.save``,
    ``ferrodist.nn`` ones with pickle. Raises ``CheckpointError`` on every rank if ``root``
    could not write it.

    Example::

        save_checkpoint("ckpt.pt", ddp_model, opt, extra={"epoch": 3})   # every rank
    """
    group = group if group is not None else default_group()
    inner = _unwrap(module)
    model = adapt(inner)
    error: BaseException | None = None
    if group.rank == root:
        state = {
            "model": inner.state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "extra": extra,
        }
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                model.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
            dir_fd = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            error = exc
            tmp.unlink(missing_ok=True)
    if _agree(group, model, error is not None):
        raise CheckpointError(
            f"rank {group.rank}: save_checkpoint: rank {root} could not write {os.fspath(path)!r}: {error or 'see its error'}"
        )


def load_checkpoint(
    path: str | os.PathLike[str],
    module: Any,
    optimizer: Any = None,
    *,
    group: Group | None = None,
    map_location: Any = None,
) -> Any:
    """Load a checkpoint written by ``save_checkpoint`` on every rank (a collective; the
    file must be visible to every rank). Returns the ``extra`` value that was saved.
    Raises ``CheckpointError`` on every rank if any rank could not read it."""
    group = group if group is not None else default_group()
    inner = _unwrap(module)
    model = adapt(inner)
    state: Any = None
    error: BaseException | None = None
    try:
        with open(path, "rb") as f:
            state = model.load(f, map_location)
        inner.load_state_dict(state["model"])
        if optimizer is not None:
            if state["optimizer"] is None:
                raise KeyError("the checkpoint holds no optimizer state")
            optimizer.load_state_dict(state["optimizer"])
    except (OSError, KeyError, ValueError, pickle.UnpicklingError, EOFError) as exc:
        error = exc
    failed = _agree(group, model, error is not None)
    if failed:
        where = f"this rank: {error}" if error is not None else "see their errors"
        raise CheckpointError(
            f"rank {group.rank}: load_checkpoint: {failed} rank(s) could not load {os.fspath(path)!r} ({where})"
        )
    return state["extra"]


def resume_checkpoint(
    path: str | os.PathLike[str],
    module: Any,
    optimizer: Any = None,
    *,
    group: Group | None = None,
    map_location: Any = None,
) -> Any:
    """Load ``path`` if rank 0 sees it, else leave the model as it is: the start of a script
    that ``ferrodist run --max-restarts`` may start again after a failure (a collective).

    Returns the ``extra`` value saved with the checkpoint (say, the next step), or None
    when there is no checkpoint yet (a first start). Every rank takes the same branch:
    rank 0 looks for the file and tells the others; a rank that then cannot read it makes
    every rank raise ``CheckpointError``.

    Example::

        start = resume_checkpoint("ckpt.pt", ddp_model, opt) or 0   # every rank
        for step in range(start, steps):
            ...
            if step % 100 == 99:
                save_checkpoint("ckpt.pt", ddp_model, opt, extra=step + 1)
    """
    group = group if group is not None else default_group()
    model = adapt(_unwrap(module))
    found = model.small(np.array([int(group.rank == 0 and os.path.exists(path))], dtype=np.int64))
    group.broadcast(found, 0)
    if not int(model.numpy(found)[0]):
        return None
    return load_checkpoint(path, module, optimizer, group=group, map_location=map_location)
