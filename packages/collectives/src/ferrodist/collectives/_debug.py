"""Debug mode: before each collective, the ranks compare what they are about to call.

Turned on by ``init_process_group(debug=True)`` or ``FERRODIST_DEBUG=detail``. Each rank
sends every other member a small record (the call's fingerprint and the tensor's shape)
and checks all records agree; if they do not, every rank raises the same
``CollectiveMismatch`` listing which ranks called what. It costs one small exchange per
collective, so it is for hunting bugs, not for production runs.
"""

from __future__ import annotations

import os

import numpy as np

from ferrodist.core import CollectiveMismatch

from ._call import Call
from ._fingerprint import describe

_MAX_DIMS = 8
_DEBUG_BIT = 1 << 63


def enabled_by_environment() -> bool:
    return os.environ.get("FERRODIST_DEBUG", "").lower() in ("detail", "1", "true", "yes")


def debugging_routes() -> bool:
    """Whether ``FERRODIST_DEBUG`` asks for every plan and CUDA route to be printed
    (``route`` among its comma-separated words)."""
    return "route" in os.environ.get("FERRODIST_DEBUG", "").split(",")


def _record(fingerprint: int, shape: tuple[int, ...]) -> np.ndarray:
    record = np.zeros(2 + _MAX_DIMS, np.uint64)
    record[0] = fingerprint
    record[1] = len(shape)
    record[2 : 2 + min(len(shape), _MAX_DIMS)] = shape[:_MAX_DIMS]
    return record


def _words(record: np.ndarray) -> str:
    call = describe(int(record[0]))
    ndim = int(record[1])
    dims = ", ".join(str(int(d)) for d in record[2 : 2 + min(ndim, _MAX_DIMS)])
    shape = f"({dims}{',' if ndim == 1 else ''}{', ...' if ndim > _MAX_DIMS else ''})"
    return f"{call} with shape {shape}"


def check_agreement(call: Call, shape: tuple[int, ...]) -> None:
    """Exchange (fingerprint, shape) with every member; raise if any rank differs."""
    mine = _record(call.fingerprint, shape)
    if call.size == 1:
        return
    records = np.zeros((call.size, mine.size), np.uint64)
    records[call.rank] = mine
    debug_call = Call(
        call.transport, call.ranks, call.rank, call.tag | _DEBUG_BIT, call.deadline, call.scratch, fingerprint=0
    )
    requests = [debug_call.irecv(records[peer], peer) for peer in range(call.size) if peer != call.rank]
    for peer in range(call.size):
        if peer != call.rank:
            debug_call.wait(debug_call.isend(mine, peer))
    debug_call.wait_all(requests)
    if (records == records[0]).all():
        return
    groups: dict[bytes, list[int]] = {}
    for peer in range(call.size):
        groups.setdefault(records[peer].tobytes(), []).append(call.ranks[peer])
    calls = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {ranks if len(ranks) > 1 else ranks[0]} called "
        f"{_words(np.frombuffer(key, np.uint64))}"
        for key, ranks in groups.items()
    )
    differing = [call.ranks[peer] for peer in range(call.size) if records[peer].tobytes() != mine.tobytes()]
    raise CollectiveMismatch(
        f"debug check: the ranks disagree about this call: {calls}",
        rank=call.ranks[call.rank],
        peer=differing[0],
        expected=int(mine[0]),
    )
