"""Agreeing on the live members of a failed group, so that its survivors can shrink it.

The survivors talk over the group's transport, on a channel of their own, in numbered
rounds; each round has four steps:

1. *hello*: every survivor tells every member it is here, and listens until each member
   has said so too or is gone (its connection ended), or the round's window has passed;
2. *decide*: the lowest rank a survivor heard from (itself included) decides: the ranks
   it heard from are the new group, if they are a majority of the members that are not
   gone (so that the members it did not hear from cannot make a group of their own), and
   it sends that decision to each of them;
3. *confirm*: a survivor confirms the first decision that reaches it and refuses any
   other (a confirmation binds it: it then waits for that decider's word);
4. *commit*: with every confirmation, the decider commits (each member passes the commit
   on to the others before it returns, so that a decider lost in the middle does not
   split them) and tells every live member it left out (``Excluded`` there); with a
   refusal, a member lost or a confirmation that did not come, it calls the round off.

A survivor that hears of a later round than its own joins it (unless a confirmation binds
it), so that ranks that entered at different times meet. Every rank returns the same
members or raises: a rank left out raises ``Excluded``; at the deadline, a rank in no
group raises ``Excluded`` (it never found a majority) or ``CollectiveTimeout``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ferrodist.core import CollectiveTimeout, Excluded, FerrodistError, InvalidArgument, InvalidRank
from ferrodist.transport import Request, Transport

from .._call import p2p_tag, subgroup_channel

HELLO, DECIDE, CONFIRM, REFUSE, COMMIT, CALL_OFF, EXCLUDED = range(1, 8)
_HEADER = 4  # kind, attempt, round, count; the ranks follow
_log = logging.getLogger("ferrodist.collectives")
_POLL = 0.005  # seconds between looks at the inbox: the waits sleep, they never spin

#: Seconds a round waits for a member that has not said it is here (``shrink(window=)``).
DEFAULT_WINDOW = 5.0


def channel(group_name: str) -> int:
    """The channel the survivors of group ``group_name`` agree on: every member derives the
    same one, apart from the group's own (aborted) channel."""
    return subgroup_channel(f"{group_name}/shrink")


class _Agreement:
    """One rank's part in one agreement (see the module's docstring)."""

    def __init__(
        self,
        transport: Transport,
        members: Sequence[int],
        channel: int,
        attempt: int,
        exclude: Sequence[int],
        deadline: float,
        window: float,
        what: str,
    ) -> None:
        self.t = transport
        self.me = transport.rank
        self.members = tuple(members)
        self.exclude = frozenset(exclude)
        self.tag = p2p_tag(channel, 0)
        self.attempt = attempt
        self.deadline = deadline
        self.window = window
        self.what = what
        self.others = [m for m in self.members if m != self.me and m not in self.exclude]
        self.inbox: dict[int, tuple[Request, np.ndarray[Any, Any]]] = {}
        self.heard: dict[int, set[int]] = {}  # round -> members that said hello in it
        self.minority = True  # no round of this rank found a majority (yet)
        self.round = -1
        self.phase = ""
        self.phase_end = 0.0
        self.decision: tuple[int, ...] = ()  # the decision this rank made or confirmed
        self.decider = -1
        self.confirmed: set[int] = set()
        for m in self.others:
            self._post(m)

    # -- messages --------------------------------------------------------------------------------
    def _post(self, peer: int) -> None:
        buf = np.zeros(_HEADER + len(self.members), np.int64)
        try:
            self.inbox[peer] = (self.t.irecv(buf, peer, self.tag), buf)
        except FerrodistError:  # gone already
            self.inbox.pop(peer, None)

    def _send(self, peer: int, kind: int, round_: int, ranks: Sequence[int] = ()) -> None:
        msg = np.full(_HEADER + len(self.members), -1, np.int64)
        msg[:_HEADER] = (kind, self.attempt, round_, len(ranks))
        msg[_HEADER : _HEADER + len(ranks)] = ranks
        try:
            self.t.isend(msg, peer, self.tag)
        except (FerrodistError, OSError):
            pass  # a lost peer: the steps that need it notice that it is gone

    def _messages(self) -> list[tuple[int, int, int, int, tuple[int, ...]]]:
        """The messages that arrived since the last look, every one kept for this rank, in the
        order each peer sent them: (sender, kind, attempt, round, ranks)."""
        out = []
        for peer in list(self.inbox):
            while peer in self.inbox and self.inbox[peer][0].is_completed():
                request, buf = self.inbox.pop(peer)
                try:
                    request.wait(0.0)
                except FerrodistError:
                    break  # the peer is gone or the message was not ours: read no more from it
                count = int(buf[3])
                ranks = tuple(int(r) for r in buf[_HEADER : _HEADER + max(0, min(count, len(self.members)))])
                out.append((peer, int(buf[0]), int(buf[1]), int(buf[2]), ranks))
                self._post(peer)
        return out

    def close(self) -> None:
        """Take back the receives still posted (a message that comes later stays unread)."""
        for request, _ in self.inbox.values():
            try:
                request.wait(0.0)
            except FerrodistError:
                pass
        self.inbox.clear()

    # -- the rounds ------------------------------------------------------------------------------
    def _gone(self) -> frozenset[int]:
        return self.t.gone() & frozenset(self.members)

    def _start(self, round_: int) -> None:
        """Begin round ``round_`` (or the latest a member said hello in, if later): say hello
        to every member not known to be gone."""
        round_ = max(round_, max(self.heard, default=round_))
        self.round, self.phase, self.phase_end = round_, "hello", time.monotonic() + self.window
        self.decision, self.decider, self.confirmed = (), -1, set()
        gone = self._gone()
        for m in self.others:
            if m not in gone:
                self._send(m, HELLO, round_)

    def _decide(self) -> tuple[int, ...] | None:
        """The hello step is over: decide (as the lowest rank heard from) or wait for a
        decision; the members, where this rank alone is left of them."""
        heard = sorted((self.heard.get(self.round, set()) - self._gone()) | {self.me})
        self.phase_end = time.monotonic() + self.window
        if heard[0] != self.me:
            self.phase, self.decider = "wait", heard[0]
            return None
        gone = self._gone()
        voters = [m for m in self.members if m not in gone and m not in self.exclude]
        if 2 * len(heard) <= len(voters):
            for m in heard[1:]:
                self._send(m, DECIDE, self.round)  # no decision: go on to the next round
            self._start(self.round + 1)
            return None
        self.minority = False
        self.phase, self.decision, self.decider = "collect", tuple(heard), self.me
        if len(heard) == 1:
            return self._commit()
        for m in heard[1:]:
            self._send(m, DECIDE, self.round, heard)
        return None

    def _commit(self) -> tuple[int, ...]:
        """Every member confirmed: commit, and tell the live members left out."""
        for m in self.decision:
            if m != self.me:
                self._send(m, COMMIT, self.round, self.decision)
        gone = self._gone()
        for m in self.others:
            if m not in self.decision and m not in gone:
                self._send(m, EXCLUDED, self.round, self.decision)
        return self.decision

    def _committed(self) -> tuple[int, ...]:
        """A commit reached this member: pass it on (the decider may be lost half-way), return."""
        for m in self.decision:
            if m not in (self.me, self.decider):
                self._send(m, COMMIT, self.round, self.decision)
        return self.decision

    def _call_off(self) -> None:
        for m in self.decision:
            if m != self.me:
                self._send(m, CALL_OFF, self.round)
        self._start(self.round + 1)

    def _handle(
        self, peer: int, kind: int, attempt: int, round_: int, ranks: tuple[int, ...]
    ) -> tuple[int, ...] | None:
        """One message; the members of the new group once it is committed here, else None."""
        if kind == EXCLUDED:
            raise Excluded(
                f"{self.what}: the other members made a group of ranks {list(ranks)} without this rank "
                "(it did not answer them in time); this process should exit",
                survivors=ranks,
                rank=self.me,
                operation="shrink",
            )
        if attempt != self.attempt:
            return None
        if kind == HELLO:
            self.heard.setdefault(round_, set()).add(peer)
            if round_ > self.round and self.phase != "confirmed":
                if self.phase == "collect":
                    self._call_off()
                self._start(round_)
        elif kind == DECIDE:
            if not ranks:  # the decider found no majority: on to the next round
                if round_ == self.round and self.phase == "wait" and peer == self.decider:
                    self._start(round_ + 1)
            elif round_ < self.round or self.phase == "confirmed" or (self.phase == "collect" and round_ == self.round):
                self._send(peer, REFUSE, round_)
            else:
                if self.phase == "collect":
                    self._call_off()
                self.round, self.phase, self.decider, self.decision = round_, "confirmed", peer, ranks
                self.phase_end = self.deadline  # bound to the decider: no end of its own
                self.minority = False
                self._send(peer, CONFIRM, round_)
        elif self.phase == "collect" and round_ == self.round:
            if kind == CONFIRM:
                self.confirmed.add(peer)
                if self.confirmed >= set(self.decision) - {self.me}:
                    return self._commit()
            elif kind == REFUSE:
                self._call_off()
        elif self.phase == "confirmed" and round_ == self.round and peer in self.decision:
            if kind == COMMIT and ranks == self.decision:
                return self._committed()
            if kind == CALL_OFF and peer == self.decider:
                self._start(round_ + 1)
        return None

    def _timed_out(self) -> tuple[int, ...] | None:
        """The current step's time is up, or whom it waits for is gone."""
        if self.phase == "hello":
            return self._decide()
        if self.phase == "collect":
            self._call_off()
        else:  # waiting for a decision, or bound to a decider that is gone
            self._start(self.round + 1)
        return None

    def _step_over(self) -> bool:
        """Whether the current step can end before its time: everyone it waits for has
        answered, or is gone."""
        gone = self._gone()
        if self.phase == "hello":
            heard = self.heard.get(self.round, set())
            return all(m in heard or m in gone for m in self.others)
        if self.phase == "wait":
            return self.decider in gone
        if self.phase == "collect":
            return any(m in gone for m in self.decision)
        if self.decider in gone and self.phase_end == self.deadline:
            # Bound to a decider that is lost: its commit may have reached another member,
            # who passes it on; wait one window for that, then start over.
            self.phase_end = min(self.deadline, time.monotonic() + self.window)
        return False

    def run(self) -> tuple[int, ...]:
        self._start(0)
        try:
            while True:
                for message in self._messages():
                    done = self._handle(*message)
                    if done is not None:
                        return done
                now = time.monotonic()
                if now >= self.deadline:
                    raise self._failed()
                if self._step_over() or now >= self.phase_end:
                    done = self._timed_out()
                    if done is not None:
                        return done
                    continue
                time.sleep(_POLL)
        finally:
            self.close()

    def _failed(self) -> FerrodistError:
        gone = sorted(self._gone())
        lost = f" (ranks {gone} are gone)" if gone else ""
        if self.minority:
            return Excluded(
                f"{self.what}: this rank found no majority of the members to agree with before the deadline"
                f"{lost}; the others, if they are alive, went on without it: this process should exit",
                rank=self.me,
                operation="shrink",
            )
        silent = [m for m in self.others if m not in self.heard.get(self.round, set()) and m not in gone]
        return CollectiveTimeout(
            f"{self.what}: the members did not agree before the deadline (round {self.round}, {self.phase} step; "
            f"no word from ranks {silent}){lost}; shrink again, or restart the job",
            rank=self.me,
            operation="shrink",
            waiting_for=tuple(silent),
        )


def agree(
    transport: Transport,
    members: Sequence[int],
    channel: int,
    *,
    attempt: int,
    exclude: Sequence[int],
    timeout: float,
    window: float,
    what: str,
) -> tuple[int, ...]:
    """The members (global ranks, in order) that the live ones agree make the new group
    (see the module's docstring); every rank of it gets the same. ``exclude``: members
    that are out whatever they say (they take no part). Raises ``Excluded`` on a rank that
    is not in it, ``CollectiveTimeout`` where no agreement was reached by ``timeout``."""
    agreement = _Agreement(
        transport, members, channel, attempt, exclude, time.monotonic() + timeout, min(window, timeout), what
    )
    return agreement.run()


def leave(group: Any) -> None:
    """Fail, on every member, the calls of ``group`` and of the groups made from it that have
    not failed here, before agreeing: a member blocked in one of them, waiting for this rank
    (which has gone on to shrink), learns it at once instead of at its deadline, past the
    agreement's window (the stage of a pipeline waiting for its replica, while the failure
    was in the other pipeline)."""
    me, pending = group.global_rank, [group]
    while pending:
        g = pending.pop()
        pending.extend(g._children)
        if g.is_member and not g._destroyed and g._runner.order.blocked is None:
            g._runner.abort(FerrodistError(f"rank {me}: left group {g.name} to shrink group {group.name}", rank=me))


def live_members(
    group: Any, me: int, exclude: Sequence[int], timeout: float, window: float | None, attempt: int
) -> tuple[int, ...]:
    """The global ranks of ``ProcessGroup.shrink()``'s new group (see there), for ``group``,
    of which this rank is group rank ``me``: the arguments checked, the calls of the group
    and those made from it failed everywhere (``leave``), then the agreement (``attempt``:
    its number on the group, so that a second attempt does not read the first's messages);
    with ``exclude`` (group ranks), every other member must be in it."""
    transport: Transport = group.transport
    members: Sequence[int] = group.ranks
    what = f"rank {transport.rank}: shrink of group {group.name}"
    try:
        left = sorted({int(r) for r in exclude})
    except (TypeError, ValueError):
        raise InvalidArgument(f"{what}: exclude must be group ranks, not {exclude!r}", rank=transport.rank) from None
    bad = [r for r in left if not 0 <= r < len(members)]
    if bad or me in left or len(left) == len(members):
        why = f"ranks {bad} are outside it" if bad else "this rank is among them: only the others call shrink"
        raise InvalidRank(f"{what}: exclude={list(exclude)}: {why}", rank=transport.rank, operation="shrink")
    if window is not None and not window > 0:
        raise InvalidArgument(f"{what}: window must be a positive number of seconds, not {window!r}")
    out = [members[r] for r in left]
    leave(group)
    agreed = agree(
        transport,
        members,
        channel(group.name),
        attempt=attempt,
        exclude=out,
        timeout=timeout,
        window=DEFAULT_WINDOW if window is None else float(window),
        what=what,
    )
    missing = [r for r in members if r not in agreed and r not in out]
    if out and missing:
        raise CollectiveTimeout(
            f"{what}: exclude={list(exclude)} leaves ranks {missing} in, but they took no part (they are gone or "
            "silent): exclude them too",
            rank=transport.rank,
            operation="shrink",
            waiting_for=tuple(missing),
        )
    if missing:
        _log.warning("%s: left out ranks %s (gone or silent); the new group has ranks %s", what, missing, list(agreed))
    return agreed
