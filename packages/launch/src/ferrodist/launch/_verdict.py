"""Which rank a failed job is blamed on: the launcher's summary line, from plain values.

When a rank dies, the others usually fail too, a moment later, reporting it (``PeerLost``,
``CollectiveTimeout``); when a rank freezes, the others time out while it still runs and
the launcher stops it. The first rank to exit is often only a reporter. So the launcher
records how every rank ended (``RankEnd``: exit code, the order it saw the exits in, the
signal it sent the rank while it still ran, what the rank wrote to its error file) and
``diagnose`` names the root cause, in this order:

1. a rank killed by a signal the launcher did not send (the first one seen);
2. else the first rank that failed with its own error: an exit code with no error file,
   or an error file that blames no other rank (also when the rank was still on its way
   out, say in its cleanup, when the launcher stopped it);
3. else the ranks the reporters blame (the ranks a timeout waited for, the peer that was
   lost) that are not reporters themselves: ranks that froze, never arrived, or left;
   when every rank reports another, the rank the first report blames, if its own report
   came later (it froze, and failed when it resumed: what it blames, it read from the
   others' failures);
4. else the first rank that failed.

The error file is what ``ferrodist.collectives`` writes to ``FERRODIST_ERROR_FILE`` on a
rank's first error (see ``collectives/_failures/record.py``): one JSON object such as
``{"error": "PeerLost", "blames": [1], "message": "..."}``.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RankEnd", "RankError", "Verdict", "diagnose", "read_error"]


@dataclass(frozen=True)
class RankError:
    """What a rank wrote to its error file: the error's class, the other ranks it blames."""

    name: str
    blames: tuple[int, ...] = ()
    message: str = ""
    at: float | None = None  # when the rank wrote it (time.time()), if it said


@dataclass(frozen=True)
class RankEnd:
    """How one rank ended.

    Attributes:
        rank: the rank.
        code: its return code (negative: killed by that signal).
        seen: the order the launcher saw it exit in (0: the first).
        stopped: the signal the launcher sent it while it was still running, else ``None``.
        error: what it wrote to its error file, if anything.
    """

    rank: int
    code: int
    seen: int
    stopped: int | None = None
    error: RankError | None = None

    @property
    def failed_itself(self) -> bool:
        """It exited non-zero, or was killed, before the launcher signalled it."""
        return self.code != 0 and self.stopped is None

    @property
    def blames(self) -> tuple[int, ...]:
        """The other ranks its error is about (empty: its own error, or no error file)."""
        return tuple(r for r in self.error.blames if r != self.rank) if self.error else ()


@dataclass(frozen=True)
class Verdict:
    """The outcome of a job: what ``ferrodist run`` exits with, the ranks it blames (first:
    the root cause), and its summary line (empty when every rank succeeded)."""

    exit_code: int
    culprits: tuple[int, ...]
    summary: str


def finished_without(ranks: int, failed: Sequence[int]) -> str:
    """The summary of an elastic job that finished without ``failed`` (of ``ranks`` in all),
    which it went on without (``ferrodist run -n MIN:MAX``)."""
    return f"ferrodist run: the job finished on {ranks - len(failed)} of {ranks} ranks; ranks {sorted(failed)} failed"


def read_error(path: str) -> RankError | None:
    """The error file at ``path``, or ``None`` if there is none or it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        name = str(record["error"])
        blames = tuple(int(r) for r in record.get("blames", ()))
        at = record.get("at")
        return RankError(name, blames, str(record.get("message", "")), float(at) if at is not None else None)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def describe(code: int) -> str:
    """``exited with code 3``, ``was killed by SIGKILL``."""
    if code < 0:
        return f"was killed by {signal_name(-code)}"
    return f"exited with code {code}"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_code_of(code: int) -> int:
    """The shell's convention: the code itself, or 128 + the signal that killed it."""
    return code if code >= 0 else 128 - code


def diagnose(ends: Sequence[RankEnd], *, interrupted: int | None = None) -> Verdict:
    """The verdict on a job whose ranks ended as ``ends`` (one per rank, any order).

    ``interrupted``: the signal the launcher received and passed on to the ranks (the job
    was stopped from outside, so no rank is to blame).

    Example:
        >>> diagnose([RankEnd(0, 1, 0, error=RankError("PeerLost", (1,))), RankEnd(1, -9, 1)]).summary
        'ferrodist run: rank 1 was killed by SIGKILL; failed because of it: ranks [0]'
    """
    ends = sorted(ends, key=lambda e: e.rank)
    by_rank = {e.rank: e for e in ends}
    if interrupted is not None:
        passed = [e.rank for e in ends if e.stopped is not None]
        summary = f"ferrodist run: interrupted by {signal_name(interrupted)}, passed on to ranks {passed}"
        return Verdict(128 + interrupted, (), summary + _forced(ends))
    failed = sorted((e for e in ends if e.failed_itself), key=lambda e: e.seen)
    if not failed:
        return Verdict(0, (), "")
    reporters = {e.rank for e in ends if e.blames}
    killed = [e for e in failed if e.code < 0]
    # A rank that wrote an error of its own failed by itself, even if the launcher stopped
    # it before it was out (a rank still in its cleanup, or its threads' shutdown).
    erred = sorted(
        (
            e
            for e in ends
            if e.error is not None and not e.blames and e.stopped is not None and e.error.name not in _WAITS
        ),
        key=lambda e: e.seen,
    )
    own = [e for e in failed if e.rank not in reporters] + erred
    if killed or own:
        cause = (killed or own)[0]
        if cause.failed_itself:
            what = f"rank {cause.rank} {describe(cause.code)}"
            if cause.error is not None:
                what += f" ({cause.error.name})"
        else:
            assert cause.error is not None  # erred
            what = f"rank {cause.rank} failed with {_said(cause.error)} (the launcher stopped it on its way out)"
        culprits: tuple[int, ...] = (cause.rank,)
    else:
        culprits, what = _blamed(ends, reporters, by_rank)
        if not culprits:  # the reporters blame each other: one that was blamed first, then reported?
            culprits, what = _blamed(ends, reporters - _blamed_first(ends), by_rank)
        if not culprits:  # rule 4
            cause = failed[0]
            culprits, what = (cause.rank,), f"rank {cause.rank} {describe(cause.code)}"
    summary = f"ferrodist run: {what}"
    followers = [e.rank for e in failed if e.rank in reporters and e.rank not in culprits]
    if followers and (killed or own):
        summary += f"; failed because of it: ranks {followers}"
    others = [e.rank for e in failed if e.rank not in reporters and e.rank not in culprits]
    if others:
        summary += f"; also failed: ranks {others}"
    stopped = [e.rank for e in ends if e.stopped is not None]
    if stopped:
        summary += f"; stopped by the launcher: ranks {stopped}" + _forced(ends)
    culprit = by_rank[culprits[0]]
    code = culprit.code if culprit.failed_itself else failed[0].code
    return Verdict(exit_code_of(code), culprits, summary)


def _blamed(ends: Sequence[RankEnd], reporters: set[int], by_rank: dict[int, RankEnd]) -> tuple[tuple[int, ...], str]:
    """Rule 3: the ranks the reporters blame that are not reporters themselves, and the
    phrase naming them (``rank 2 did not come to the call in time: ranks [0, 1] timed out
    waiting for it ...``)."""
    blamed = sorted({r for e in ends for r in e.blames if r not in reporters and r in by_rank})
    if not blamed:
        return (), ""
    accusers = [e for e in ends if set(e.blames) & set(blamed)]
    names = {e.error.name for e in accusers if e.error}
    one = len(blamed) == 1
    if names == {"CollectiveTimeout"}:  # it may have run calls before and then frozen: not "never arrived"
        what, how = "did not come to the call in time", "timed out waiting for"
    elif names == {"PeerLost"}:
        what, how = "was lost" if one else "were lost", "lost their connection to"
    else:
        what, how = "was missing" if one else "were missing", "failed waiting for"
    who, them = (f"rank {blamed[0]}", "it") if one else (f"ranks {blamed}", "them")
    fates = []
    for rank in blamed:
        end = by_rank[rank]
        if end.stopped is not None:
            fates.append(f"rank {rank} was still running when the launcher stopped it")
        else:
            fates.append(f"rank {rank} {describe(end.code)}")
    phrase = f"{who} {what}: ranks {[e.rank for e in accusers]} {how} {them} ({'; '.join(fates)})"
    return tuple(blamed), phrase


def _blamed_first(ends: Sequence[RankEnd]) -> set[int]:
    """The ranks the earliest report blames whose own report came after it: they froze (or
    were slow) past the others' deadline and failed once they resumed, reporting what the
    others' failures told them; empty when the reports do not say when they were written."""
    timed = sorted((e.error.at, e) for e in ends if e.blames and e.error is not None and e.error.at is not None)
    if not timed:
        return set()
    first_at, first = timed[0]
    return {
        r
        for r in first.blames
        if (own := next((e for e in ends if e.rank == r), None)) is not None
        and own.error is not None
        and own.error.at is not None
        and own.error.at > first_at
    }


#: Errors that say a rank waited for others: never a rank's own failure, blames or not.
_WAITS = frozenset({"CollectiveTimeout", "PeerLost", "GroupAborted"})


def _said(error: RankError) -> str:
    """An error file's error in a few words: its class, and its message without the prefixes."""
    text = re.sub(r"^(rank \d+: )+", "", error.message)
    text = text if len(text) <= 120 else text[:117] + "..."
    return f"{error.name}: {text}" if text else error.name


def _forced(ends: Sequence[RankEnd]) -> str:
    """`` (ranks [..] did not stop and got SIGKILL)``: the stopped ranks SIGKILL had to end."""
    forced = [e.rank for e in ends if e.stopped not in (None, signal.SIGKILL) and e.code == -signal.SIGKILL]
    return f" (ranks {forced} did not stop and got SIGKILL)" if forced else ""
