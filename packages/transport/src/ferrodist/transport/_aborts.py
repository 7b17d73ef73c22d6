"""Aborted channels: how a failure on one rank reaches every rank of its group.

Tags carry a *channel* in their upper half (``channel_of``): the collectives put a group's
id there, so all the messages of one group share a channel. When a collective fails on
one rank, that rank aborts the channel: its own pending and later receives and sends on
the channel fail with the error, and every peer of the group gets an abort *notice*
(the error, and the number of the call the sender was in), after which the same holds
there. A notice is also a sign of life: after a timeout, the ranks a rank heard from
were alive and in the call, the ones it did not hear from are the culprits.

``Aborts`` is the bookkeeping each transport keeps; notices travel as JSON (a class
name from ``ferrodist.core``'s hierarchy, the message and the plain attributes), never
as pickles.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import ferrodist.core as core
from ferrodist.core import FerrodistError, PeerLost

__all__ = ["CHANNEL_SHIFT", "Aborts", "Notice", "channel_of", "decode_notice", "departure", "encode_notice", "fresh"]

CHANNEL_SHIFT = 32
_CHANNEL_MASK = (1 << 31) - 1  # bit 63 of a tag is free for the collectives' own use
_ATTRIBUTES = ("peer", "waiting_for", "expected", "received", "operation")


def channel_of(tag: int) -> int:
    """The channel a tag belongs to (its bits 32..62)."""
    return (tag >> CHANNEL_SHIFT) & _CHANNEL_MASK


class Notice(NamedTuple):
    """What a peer's abort notice said: the call it was in, and the failure that held it up
    first when that was another group's (so blame can follow it), else None. ``between``:
    the peer was between calls (it had finished call ``seq`` and answered for itself), not
    stuck inside call ``seq``."""

    seq: int
    earlier: str | None
    between: bool = False
    #: The one rank the peer was waiting for when it failed: its own timeout's, or that of
    #: its receive that another rank's failure stopped (then ``relayed`` too).
    waited: int | None = None
    #: The peer's failure came from another rank (it passed on a notice, or was between calls).
    relayed: bool = False


def encode_notice(
    seq: int, error: FerrodistError, origin: int, earlier: FerrodistError | None = None, *, limit: int | None = None
) -> bytes:
    """An abort notice: ``origin`` failed in call ``seq`` with ``error`` (after ``earlier``,
    a failure of another group, when there was one). With ``limit`` (the bytes a receiver
    takes), a notice whose message or list of ranks is very long is cut to fit."""
    data = _encode_notice(seq, error, origin, earlier)
    if limit is None or len(data) <= limit:
        return data
    short = copy.copy(error)
    short.args = (error.message[: 16 << 10] + " [...]",)
    if len(getattr(short, "waiting_for", ())) > 1024:
        short.waiting_for = short.waiting_for[:1024]  # type: ignore[attr-defined]
    return _encode_notice(seq, short, origin, None)


def _encode_notice(seq: int, error: FerrodistError, origin: int, earlier: FerrodistError | None) -> bytes:
    attributes = {}
    for name in _ATTRIBUTES:
        value = getattr(error, name, None)
        if isinstance(value, tuple):
            value = list(value)
        if value is not None:
            attributes[name] = value
    record = {"class": type(error).__name__, "message": error.message, "origin": origin, "seq": seq, **attributes}
    if earlier is not None and earlier is not error:
        record["earlier"] = earlier.message
    if error.between:
        record["between"] = True
    if error.aborted_by is not None:
        record["relayed"] = True
        if error.awaited is not None:  # the receive that the failure passed on stopped here
            record["waited"] = int(error.awaited)
    elif isinstance(error, core.CollectiveTimeout) and len(error.waiting_for) == 1:
        record["waited"] = int(error.waiting_for[0])
    return json.dumps(record).encode()


def decode_notice(data: bytes, rank: int, peer: int) -> tuple[int, FerrodistError]:
    """(call number, error) of a notice that ``peer`` sent; the error is raised on ``rank``."""
    try:
        record = json.loads(bytes(data).decode())
        cls = getattr(core, str(record["class"]), None)
        seq = int(record["seq"])
        message = str(record["message"])
    except (ValueError, KeyError, TypeError):
        return -1, core.ProtocolError(f"rank {peer} sent an abort notice this rank cannot read", rank=rank)
    if not (isinstance(cls, type) and issubclass(cls, FerrodistError)):
        cls = FerrodistError
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.rank = rank
    error.operation = record.get("operation")
    defaults: dict[str, Any] = {"peer": None, "waiting_for": (), "expected": 0, "received": 0}
    for name, default in defaults.items():
        value = record.get(name, default)
        setattr(error, name, tuple(value) if isinstance(value, list) else value)
    error.aborted_by = peer
    error.notice = message
    earlier = record.get("earlier")
    error.earlier = str(earlier) if earlier is not None else None
    error.between = bool(record.get("between"))
    waited = record.get("waited")
    error.__dict__["waited"] = waited if isinstance(waited, int) else None  # the notice's: see Aborts.hear
    error.__dict__["relayed"] = bool(record.get("relayed"))
    return seq, error


class Aborts:
    """The aborted channels this rank knows of, and the notices its peers sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: dict[int, FerrodistError] = {}
        self._notified: set[int] = set()
        self._heard: dict[int, dict[int, Notice]] = {}
        self._watchers: dict[int, Callable[[FerrodistError, int], None]] = {}

    def watch(self, channel: int, respond: Callable[[FerrodistError, int], None]) -> None:
        """Call ``respond(error, seq)``, in a thread of its own, when a peer's notice is the first
        to abort ``channel`` here (the group answers with its own notice: see ``_runner``)."""
        with self._lock:
            self._watchers[channel] = respond

    def first(self, other_than: int | None = None) -> FerrodistError | None:
        """The first error that aborted a channel here (other than ``other_than``), or None."""
        with self._lock:
            return next((e for c, e in self._errors.items() if c != other_than), None)

    def error(self, channel: int) -> FerrodistError | None:
        """The error that aborted ``channel``, or None (a dict lookup: cheap on hot paths)."""
        return self._errors.get(channel)

    def record(self, channel: int, error: FerrodistError) -> None:
        """Mark ``channel`` aborted by ``error`` (the first error stays)."""
        with self._lock:
            self._errors.setdefault(channel, error)

    def notify_once(self, channel: int) -> bool:
        """True the first time it is asked for ``channel``: this rank sends its notices then."""
        with self._lock:
            if channel in self._notified:
                return False
            self._notified.add(channel)
            return True

    def hear(self, channel: int, peer: int, seq: int, error: FerrodistError) -> None:
        """``peer`` aborted ``channel`` in call ``seq`` with ``error``."""
        between = bool(error.__dict__.pop("between", False))  # the notice's, not the error's: copies must not carry it
        waited, relayed = error.__dict__.pop("waited", None), bool(error.__dict__.pop("relayed", False))
        with self._lock:
            first = channel not in self._errors
            self._errors.setdefault(channel, error)
            self._heard.setdefault(channel, {})[peer] = Notice(seq, error.earlier, between, waited, relayed or between)
            respond = self._watchers.get(channel) if first else None
        if respond is not None:
            threading.Thread(target=respond, args=(error, seq), name=f"ferrodist-abort-{channel}", daemon=True).start()

    def heard(self, channel: int) -> dict[int, Notice]:
        """Peers that sent a notice for ``channel``: the call each was in, and its earlier failure."""
        with self._lock:
            return dict(self._heard.get(channel, {}))


def departure(rank: int, peer: int, why: bytes) -> PeerLost:
    """The error for a peer that closed its transport because of a failure it names: the
    culprit (``peer`` attribute) is the rank that failure names, not the messenger."""
    _, cause = decode_notice(why, rank, peer)
    named = getattr(cause, "peer", None)
    waited = getattr(cause, "waiting_for", ())
    culprit = named if named is not None and named != peer else (waited[0] if waited else peer)
    lost = PeerLost(f"rank {peer} closed its transport after a failure there: {cause.notice}", peer=culprit, rank=rank)
    lost.told_by = peer  # type: ignore[attr-defined]  # the messenger; its failure's words and culprit are its own
    return lost


def fresh(error: FerrodistError, context: str, awaited: int | None = None) -> FerrodistError:
    """A new exception carrying a recorded error's class and attributes, for one more waiter
    (``awaited``: the rank a failed receive was waiting for)."""
    fresh = error.with_context(context)
    fresh.awaited = awaited
    return fresh
