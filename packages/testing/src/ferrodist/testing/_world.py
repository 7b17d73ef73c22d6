"""``run_world``: run a function on n simulated ranks (threads) and collect their results."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ferrodist.collectives import (
    Faults,
    SimulatedTransport,
    destroy_process_group,
    enable_two_levels,
    init_process_group,
    is_initialized,
)
from ferrodist.core import CollectiveTimeout, InvalidArgument, PeerLost

__all__ = ["run_world"]

T = TypeVar("T")


def run_world(
    world_size: int,
    fn: Callable[..., T],
    *args: Any,
    timeout: float = 30.0,
    run_timeout: float = 300.0,
    faults: Faults | None = None,
    nodes: Sequence[int] | None = None,
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return each rank's result.

    Each rank is a thread with its own default process group (so inside ``fn``,
    ``get_rank()``, ``all_reduce(x)`` and friends work as in a real job). When a rank
    raises, its transport closes so that ranks waiting on it fail at once with
    ``PeerLost``; ``run_world`` then re-raises the *first* failure (the cause, not its
    echoes) with a note naming its rank. Exceptions carry ``.rank`` when they are
    ferrodist errors.

    Args:
        world_size: number of ranks (1 or more).
        timeout: the default timeout of every collective and receive inside ``fn``.
        run_timeout: the longest the whole run may take; ranks still running after it
            are abandoned and ``CollectiveTimeout`` names them.
        faults: failures to inject (a slow rank, a rank that dies or goes silent at its
            n-th message), see ``ferrodist.transport.Faults``.
        nodes: run the ranks as simulated nodes of these many ranks each (ranks numbered
            node by node): the world's collectives then go over two levels, as in a job
            over several hosts (``enable_two_levels``). The faults apply between nodes.

    Example:
        >>> def step():
        ...     x = np.array([get_rank() + 1.0])
        ...     all_reduce(x)
        ...     return x[0]
        >>> run_world(3, step)
        [6.0, 6.0, 6.0]
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgument(f"run_world: world_size must be an integer >= 1, not {world_size!r}")
    transports = SimulatedTransport.create_group(world_size, timeout=timeout, faults=faults)
    places, inner = _simulated_nodes(world_size, nodes, timeout)
    results: list[Any] = [None] * world_size
    failures: list[tuple[float, int, BaseException]] = []
    lock = threading.Lock()

    def main(rank: int) -> None:
        try:
            init_process_group("simulated", transport=transports[rank], timeout=timeout)
            if places is not None:
                enable_two_levels(places=places, node_transport=inner[rank])
            results[rank] = fn(*args, **kwargs)
        except BaseException as exc:
            with lock:
                failures.append((time.monotonic(), rank, exc))
            transports[rank].close()
            mine = inner[rank]
            if mine is not None:
                mine.close()
        finally:
            if is_initialized():
                destroy_process_group()

    threads = [
        threading.Thread(target=main, args=(r,), name=f"ferrodist-rank-{r}", daemon=True) for r in range(world_size)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + run_timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, thread in enumerate(threads) if thread.is_alive()]
    if stuck:
        for t in [*transports, *inner]:
            if t is not None:
                t.close()  # wake ranks blocked in ferrodist calls
        raise CollectiveTimeout(
            f"run_world: ranks {stuck} of {world_size} were still running after {run_timeout:g} s",
            waiting_for=tuple(stuck),
        )
    if failures:
        raise _first_cause(failures, world_size)
    return results


def _simulated_nodes(
    world_size: int, nodes: Sequence[int] | None, timeout: float
) -> tuple[list[tuple[int, int]] | None, list[SimulatedTransport | None]]:
    """Each rank's (node, local rank) and its transport inside its node (None alone on one)."""
    if nodes is None:
        return None, [None] * world_size
    sizes = list(nodes)
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes) or sum(sizes) != world_size:
        raise InvalidArgument(
            f"run_world: nodes must be ranks per node (integers >= 1) adding up to {world_size}, not {nodes!r}"
        )
    places: list[tuple[int, int]] = []
    inner: list[SimulatedTransport | None] = []
    for node, size in enumerate(sizes):
        group = SimulatedTransport.create_group(size, timeout=timeout) if size > 1 else [None]
        places += [(node, local) for local in range(size)]
        inner += group
    return places, inner


def _first_cause(failures: list[tuple[float, int, BaseException]], world_size: int) -> BaseException:
    """The earliest failure that is not only an echo (PeerLost) of another rank's failure."""
    failures.sort(key=lambda item: item[0])
    causes = [f for f in failures if not isinstance(f[2], PeerLost)] or failures
    _, rank, exc = causes[0]
    others = sorted(r for _, r, _ in failures if r != rank)
    note = f"raised on rank {rank} of {world_size} in run_world"
    if others:
        note += f" (ranks {others} failed after it)"
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    return exc
