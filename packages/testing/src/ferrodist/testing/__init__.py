"""ferrodist.testing: simulated worlds, numpy references and hypothesis strategies for
testing distributed code (ferrodist's own tests use it; so can yours)."""

from . import strategies
from ._reference import (
    assert_reduced,
    reduce_values,
    reduction_tolerance,
    ref_all_gather,
    ref_all_reduce,
    ref_all_to_all,
    ref_broadcast,
    ref_gather,
    ref_reduce,
    ref_reduce_scatter,
    ref_scatter,
)
from ._world import run_world

__all__ = [
    "assert_reduced",
    "reduce_values",
    "reduction_tolerance",
    "ref_all_gather",
    "ref_all_reduce",
    "ref_all_to_all",
    "ref_broadcast",
    "ref_gather",
    "ref_reduce",
    "ref_reduce_scatter",
    "ref_scatter",
    "run_world",
    "strategies",
]
