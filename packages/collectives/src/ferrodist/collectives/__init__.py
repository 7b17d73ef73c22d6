"""ferrodist.collectives: process groups and collectives, shaped like ``torch.distributed``."""

from ferrodist.core import ReduceOp

from ._api import (
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    gather,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter,
    scatter,
    send,
)
from ._group import ProcessGroup
from ._select import ALL_REDUCE_ALGORITHMS, SMALL_MESSAGE_BYTES
from ._state import (
    default_group,
    destroy_process_group,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
)
from ._work import Work

__all__ = [
    "ALL_REDUCE_ALGORITHMS",
    "ProcessGroup",
    "ReduceOp",
    "SMALL_MESSAGE_BYTES",
    "Work",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "default_group",
    "destroy_process_group",
    "gather",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "irecv",
    "is_initialized",
    "isend",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
]
