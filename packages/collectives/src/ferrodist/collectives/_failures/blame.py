"""What a group does when one of its calls fails: say where, abort, and find the culprit.

1. The error gets the call's context (rank, operation, call number, group); a mismatch
   says what each rank called; an error that came in a peer's abort notice says so.
2. The group is aborted: the transport fails every pending and later message of the
   group's channel here and sends every member a notice (see
   ``ferrodist.transport._aborts``), and later calls on this rank raise ``GroupAborted``.
3. After a timeout (here, or in the notice that aborted this rank's call), the census:
   every member whose call fails sends a notice, so for ``GRACE`` seconds this rank
   listens for them. The members it heard from were alive and in the call; those whose
   connection ended are gone, and the error names them alone; else the silent ones never
   reached it, or are stopped or stuck: they are the ones the error names.
   No store is asked, so a frozen rank 0 costs nothing more than its silence.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ferrodist.core import CollectiveMismatch, CollectiveTimeout, FerrodistError, GroupAborted
from ferrodist.transport import Transport

from .._fingerprint import describe

#: Seconds a rank whose call timed out listens for its peers' notices (the stated slack
#: of a timeout is this plus a notice's delivery: a call raises within timeout + 1 s).
GRACE = 0.5


def framed(exc: FerrodistError, context: str, rank: int, operation: str) -> FerrodistError:
    """``exc`` with the call's context; for a mismatch, what each rank called; for an error
    from a peer's notice, which rank aborted the group."""
    error = exc.with_context(context, rank=rank, operation=operation)
    origin = exc.aborted_by
    if origin is not None:
        error.args = (f"{context}: rank {origin} aborted the group after a failure there: {exc.notice}",)
    elif isinstance(exc, CollectiveMismatch) and exc.received:
        error.args = (
            f"{context}: rank {exc.peer} is in {describe(exc.received)} while this rank is in "
            f"{describe(exc.expected)}: every rank must make the same collective calls in the "
            "same order with the same dtype, size, op and root",
        )
    return error


def census(transport: Transport, channel: int, me: int, members: Sequence[int], seq: int) -> tuple[str, list[int]]:
    """Listen up to ``GRACE`` seconds for the other members' notices; what they tell about
    call ``seq``, as a clause for the timeout's message, and the members to blame. First the
    members the transport knows are gone (their connection ended: on a crowded machine a
    healthy rank may answer later than the grace, a dead one never will), else the silent
    ones and those that had not reached the call (their notice says where they were: a rank
    between calls answers at once, see ``Runner._respond``)."""
    others = [rank for rank in members if rank != me]
    deadline = time.monotonic() + GRACE
    heard, lost = transport.notices(channel), transport.gone()
    while any(rank not in heard and rank not in lost for rank in others) and time.monotonic() < deadline:
        time.sleep(0.01)
        heard, lost = transport.notices(channel), transport.gone()
    gone = [rank for rank in others if rank in lost and rank not in heard]
    silent = [rank for rank in others if rank not in heard and rank not in lost]
    behind = {rank: notice.seq for rank, notice in heard.items() if notice.seq < seq and rank in others}
    # A rank still inside an earlier call (it failed that call itself) is held up there by
    # someone else: blame it only when there is nobody else to blame.
    stuck = {rank for rank in behind if not heard[rank].between}
    held = {rank: notice.earlier for rank, notice in heard.items() if notice.earlier}
    parts = []
    if gone:
        parts.append(
            f"rank{'s' if len(gone) > 1 else ''} {gone[0] if len(gone) == 1 else gone} left the job: "
            f"{'their connections' if len(gone) > 1 else 'its connection'} ended (exited, crashed or killed)"
        )
    if silent:
        parts.append(
            f"no word {'yet ' if gone else ''}from rank{'s' if len(silent) > 1 else ''} "
            f"{silent[0] if len(silent) == 1 else silent}: "
            f"{'they' if len(silent) > 1 else 'it'} never reached call #{seq} or stopped inside it "
            "(stopped, hung, or busy outside this group's calls)"
        )
    for rank, at in sorted(behind.items()):
        if rank in stuck:
            parts.append(f"rank {rank} was still inside call #{at}, which failed there too")
            continue
        where = f"its last call there was #{at}" if at >= 0 else "it had made no call on this group yet"
        parts.append(f"rank {rank} never reached call #{seq} ({where})")
    for rank, earlier in sorted(held.items()):
        parts.append(f"rank {rank} was held up by an earlier failure there: {earlier}")
    if not gone and not silent and not behind and not held:
        parts.append(f"every rank reached call #{seq}, so a transfer inside it is stuck or too slow for the timeout")
    if gone:
        return "; ".join(parts), gone
    blamed = silent + [rank for rank in behind if rank not in stuck]
    return "; ".join(parts), sorted(blamed or list(behind))


def follow(transport: Transport, channel: int, me: int, first: int) -> tuple[list[int], int, str]:
    """Follow the waits of the peers' abort notices from ``first`` (the rank this rank was
    waiting for), for up to ``GRACE`` seconds, to the rank that held them all up. Returns
    the ranks that were waiting too (``first`` onwards; a rank whose receive another rank's
    failure stopped counts as waiting for that receive's sender), that rank, and what it
    did: ``"silent"`` (no notice), ``"failed"`` (its own failure), ``"relayed"`` (stopped by
    another rank's failure between calls) or ``"loop"`` (the waits go round: sends and receives that do
    not match)."""
    deadline = time.monotonic() + GRACE
    while True:
        heard = transport.notices(channel)
        chain, at = [], first
        while at in heard and heard[at].waited is not None and at not in chain and at != me:
            chain.append(at)
            at = heard[at].waited  # type: ignore[assignment]
        if at in heard or at == me or at in chain or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    if at == me or at in chain:
        return chain, at, "loop"
    if at not in heard:
        return chain, at, "silent"
    return chain, at, "relayed" if heard[at].relayed else "failed"


def name_the_holdup(transport: Transport, channel: int, me: int, error: CollectiveTimeout) -> None:
    """``error`` is a timeout of this rank waiting for one peer's message, in code that drives
    the group (a pipeline's receive), or a peer's timeout that reached such a receive; the
    group is aborted already. The rank it names may be healthy and waiting itself: follow
    the notices (``follow``) and name, in the message and ``waiting_for``, the rank that held
    them all up."""
    own = error.aborted_by is None
    first = (error.waiting_for[0] if len(error.waiting_for) == 1 else None) if own else error.awaited
    if first is None or first == me:
        return
    chain, end, how = follow(transport, channel, me, first)
    if how == "relayed" or (own and not chain and how != "loop"):
        # The end was stopped by another failure (whose message, relayed here, says more),
        # or is the rank waited for (the message names it already).
        return
    if how == "loop":
        ring = [*chain[chain.index(end) :], end] if end in chain else [me, *chain, me]
        clause = (
            f"the ranks waited on each other in a loop ({' -> '.join(str(r) for r in ring)}): their sends and "
            "receives do not match (a schedule that deadlocks)"
        )
        end = first
    else:
        after = [*chain[1:], end] if chain else []  # whom each rank of the chain waited for
        waits = ", ".join(f"rank {a} for rank {b}" for a, b in zip(chain, after, strict=True))
        clause = f"this rank was waiting for rank {first}" if not own else ""
        if chain:
            clause += (", which" if clause else f"rank {first}") + f" was waiting too ({waits})"
        end_says = {
            "silent": "sent no word: it never sent, or is stopped, hung or busy elsewhere; it held the others up",
            "failed": "failed by itself and aborted the group (its own output says why)",
        }[how]
        clause += f"; rank {end} {end_says}" if chain else f", and rank {end} {end_says}"
    error.args = (f"{error.message}; {clause}",)
    error.waiting_for = (end,)


def abort(
    transport: Transport,
    channel: int,
    members: Sequence[int],
    seq: int,
    error: FerrodistError,
    context: str = "",
) -> FerrodistError:
    """Abort the group's channel with ``error`` and, for a timeout, run the census; returns
    the error to raise. A timeout's message then says first what the census found (the
    silent members, those behind), after ``context`` (the message's own prefix), and then
    what this rank was waiting for: the peer it waited on may be healthy and waiting itself."""
    me = transport.rank
    transport.abort(channel, error, peers=[rank for rank in members if rank != me], seq=seq)
    if isinstance(error, CollectiveTimeout):
        clause, blamed = census(transport, channel, me, members, seq)
        message, lead = error.message, f"{context}: "
        if context and message.startswith(lead):
            error.args = (f"{lead}{clause}; {message[len(lead) :]}",)
        else:
            error.args = (f"{message}; {clause}",)
        if blamed:
            error.waiting_for = tuple(blamed)
    return error


def blocked(cause: FerrodistError, group: str, seq: int) -> GroupAborted:
    """The error every later call on an aborted group raises."""
    return GroupAborted(
        f"group {group} was aborted by the failure of its call #{seq} ({cause.message}); every rank's later "
        "calls on it fail at once: make the group again (destroy_process_group() and init_process_group() "
        "for the world, new_group() for a subgroup)",
        cause=cause,
        rank=cause.rank,
    )
