"""ferrodist.testing: simulated worlds, numpy references and hypothesis strategies for
testing distributed code (ferrodist's own tests use it; so can yours)."""

from . import strategies
from ._netns import Host, Link, NamespacesUnavailable, two_hosts
from ._reference import (
    assert_reduced,
    reduce_values,
    reduction_tolerance,
    ref_all_gather,
    ref_all_gather_into_tensor,
    ref_all_gather_object,
    ref_all_reduce,
    ref_all_to_all,
    ref_all_to_all_single,
    ref_broadcast,
    ref_broadcast_object_list,
    ref_gather,
    ref_gather_object,
    ref_reduce,
    ref_reduce_scatter,
    ref_reduce_scatter_tensor,
    ref_scatter,
    ref_scatter_object_list,
)
from ._world import run_world

__all__ = [
    "Host",
    "Link",
    "NamespacesUnavailable",
    "assert_reduced",
    "reduce_values",
    "reduction_tolerance",
    "ref_all_gather",
    "ref_all_gather_into_tensor",
    "ref_all_gather_object",
    "ref_all_reduce",
    "ref_all_to_all",
    "ref_all_to_all_single",
    "ref_broadcast",
    "ref_broadcast_object_list",
    "ref_gather",
    "ref_gather_object",
    "ref_reduce",
    "ref_reduce_scatter",
    "ref_reduce_scatter_tensor",
    "ref_scatter",
    "ref_scatter_object_list",
    "run_world",
    "strategies",
    "two_hosts",
]
