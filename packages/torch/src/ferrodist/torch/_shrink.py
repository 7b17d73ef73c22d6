"""``shrink_group``: torch's ``torch.distributed.shrink_group`` for groups of the "ferrodist"
backend, on CPU tensors too.

torch 2.13's own ``shrink_group`` registers the shrunk group's C++ ``Backend`` in a new
torch ``ProcessGroup``; a backend written in Python is a ``ProcessGroup`` itself (torch
cannot subclass ``Backend`` in Python), so that path is closed to it. This function takes
the same steps with the group the backend makes (``FerrodistProcessGroup.shrink``): the
other groups are destroyed when the default group shrinks (its ranks are renumbered), the
old group is destroyed, and the new one takes its place in torch's registries (the default
group's too), so that ``torch.distributed``'s calls and torch's DDP run on it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ferrodist.core import InvalidArgument

from ._group import FerrodistProcessGroup
from ._register import adopt_world
from ._work import seconds

_log = logging.getLogger("ferrodist.torch")


def shrink_group(
    ranks_to_exclude: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    timeout: float | timedelta | None = None,
) -> FerrodistProcessGroup:
    """Shrink ``group`` (default: the default group) of backend "ferrodist": without the group
    ranks ``ranks_to_exclude``, as torch's ``shrink_group`` (only the others call it, and each
    of them must), or, with None, without the members the live ones agree are lost (a rank
    killed, or silent for longer than the agreement's window, which the others then tell it
    is out: ``ferrodist.core.Excluded``). The new group, renumbered in order, takes ``group``'s
    place (the default group's too; shrinking it destroys the other groups, whose ranks it
    renumbers) and is returned. ``timeout``: the agreement's deadline (default the group's).

    Example (3 ranks; rank 2 was killed, and the others' all_reduce failed)::

        ferrodist.torch.shrink_group()     # or shrink_group([2])
        dist.get_world_size()              # 2
        dist.all_reduce(x)                 # on ranks 0 and 1
    """
    default = c10d._get_default_group()
    pg = default if group is None or group is dist.group.WORLD else group
    if not isinstance(pg, FerrodistProcessGroup):
        raise InvalidArgument(
            f"shrink_group: group {c10d._get_process_group_name(pg)} is not of backend 'ferrodist' but "
            f"{dist.get_backend(pg)!r}: use torch.distributed.shrink_group for NCCL groups"
        )
    is_default = pg is default
    limit = None if timeout is None else seconds(timeout, "shrink_group")
    backend_name, store = c10d._world.pg_map[pg]
    config = c10d._world.pg_backend_config.get(pg, "")
    old_ranks = c10d.get_process_group_ranks(pg)
    made = pg.shrink(list(ranks_to_exclude or ()), timeout=limit)
    remaining = [old_ranks[pg.ferrodist_group.ranks.index(r)] for r in made.ferrodist_group.ranks]
    if is_default:
        c10d._destroy_all_other_groups(exclude_group=pg)
    name = c10d._process_group_name(remaining, use_hashed_name=True)
    try:
        dist.destroy_process_group(pg)
    except Exception:  # torch's own shrink goes on too: the new group does not depend on it
        _log.warning("shrink_group: destroying the old group failed", exc_info=True)
    c10d._cleanup_process_group_global_state(pg)
    made.setGroupName(name)
    made.setGroupDesc("default:shrunken" if is_default else f"{pg.getGroupDesc()}:shrunk")
    if is_default:
        c10d._update_default_pg(made)
        adopt_world(made)
    c10d._register_pg_in_world(
        pg=made,
        backend_name=backend_name,
        store=store,
        group_name=name,
        backend_config=config,
        rank_mapping={rank: new for new, rank in enumerate(remaining)},
    )
    return made
