"""ferrodist.collectives: process groups and collectives, shaped like ``torch.distributed``."""

from ferrodist.core import ReduceOp

# For the packages built on this one (ferrodist.torch, ferrodist.launch, ferrodist.testing):
# the type of ``ProcessGroup.transport``, the address a rank of a socket backend gives its
# peers, and the simulated transport (with its faults) that ``init_process_group(transport=)``
# takes for ranks run as threads.
from ferrodist.transport import Faults, SimulatedTransport, Transport, interface_address, local_address

from ._algorithms.select import ALL_REDUCE_ALGORITHMS, SMALL_MESSAGE_BYTES
from ._api.batch import P2POp, batch_isend_irecv
from ._api.calls import (
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object_list,
    enable_two_levels,
    gather,
    gather_object,
    irecv,
    isend,
    monitored_barrier,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    scatter_object_list,
    send,
)
from ._api.default_group import (
    default_group,
    destroy_process_group,
    get_backend,
    get_rank,
    get_world_size,
    group,
    init_process_group,
    is_available,
    is_initialized,
    new_group,
)
from ._api.replacements import admit_replacements, is_replacement
from ._api.shared import reads_in_place, shared_zeros, shares_memory
from ._api.torch_names import (
    all_gather_single,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    new_subgroups,
    recv_object_list,
    reduce_scatter_single,
    send_object_list,
)
from ._group import ProcessGroup
from ._kernels import DEFAULT_DTYPES, collective_kernels, preload
from ._start.backends import auto_backend, connect_transport, one_host
from ._work import Work

__all__ = [
    "ALL_REDUCE_ALGORITHMS",
    "DEFAULT_DTYPES",
    "Faults",
    "P2POp",
    "ProcessGroup",
    "ReduceOp",
    "SMALL_MESSAGE_BYTES",
    "SimulatedTransport",
    "Transport",
    "Work",
    "admit_replacements",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "auto_backend",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "collective_kernels",
    "connect_transport",
    "default_group",
    "destroy_process_group",
    "enable_two_levels",
    "gather",
    "gather_object",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "interface_address",
    "irecv",
    "is_available",
    "is_initialized",
    "is_replacement",
    "isend",
    "local_address",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "one_host",
    "preload",
    "reads_in_place",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    "shared_zeros",
    "shares_memory",
]
