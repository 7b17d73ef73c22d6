"""The one error hierarchy of ferrodist.

Every error ferrodist raises derives from :class:`FerrodistError` and, where one
fits, from the matching builtin too (``InvalidArgument`` is a ``ValueError``,
``CollectiveTimeout`` a ``TimeoutError``), so callers can catch either.
Messages name the operation, the rank and the bad value, and say what to do.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = [
    "AuthenticationFailed",
    "BackendUnavailable",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "DeviceUnavailable",
    "Excluded",
    "FerrodistError",
    "GroupAborted",
    "InvalidArgument",
    "InvalidRank",
    "NotInitialized",
    "PeerLost",
    "ProtocolError",
]


class FerrodistError(Exception):
    """Root of every ferrodist error.

    Attributes:
        rank: the rank that raised it, when known.
        operation: the operation that failed (``"all_reduce"``, ``"recv"``, ...), when known.
        aborted_by: when the error came in a peer's abort notice, that peer's global rank.
        notice: the text of that notice (the peer's own error message).
        earlier: in a notice, the failure of another group that held the peer up first.
        between: set on a notice sent by a rank that was between calls of the group (idle
            there, not stuck inside a call); the census reads it.
        awaited: on a receive that a peer's abort failed, the rank whose message it was
            waiting for (the error itself is the peer's).
    """

    aborted_by: int | None = None
    notice: str | None = None
    earlier: str | None = None
    between: bool = False
    awaited: int | None = None

    def __init__(self, message: str, *, rank: int | None = None, operation: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.operation = operation

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __str__(self) -> str:
        return self.message

    def with_context(self, context: str, **attributes: Any) -> FerrodistError:
        """A copy of this error whose message starts with ``context`` (and with attributes set).
        A message that starts with the rank the context starts with ("rank 0: ...") says it
        once: ``rank 0: all_reduce #1 ...: a peer was lost``, not ``...: rank 0: a peer ...``."""
        clone = copy.copy(self)
        message, lead = self.message, context.split(": ", 1)[0] + ": "
        if lead.startswith("rank ") and message.startswith(lead):
            message = message[len(lead) :]
        clone.args = (f"{context}: {message}",)
        for name, value in attributes.items():
            if getattr(clone, name, None) is None:
                setattr(clone, name, value)
        return clone

    def __reduce__(self) -> Any:
        # Keep keyword attributes across pickling (errors travel between processes).
        return (_rebuild, (type(self), self.message, dict(self.__dict__)))


def _rebuild(cls: type[FerrodistError], message: str, state: dict[str, Any]) -> FerrodistError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class InvalidArgument(FerrodistError, ValueError):
    """A bad argument: wrong dtype, shape, op, tensor layout, option value."""


class InvalidRank(InvalidArgument):
    """A rank outside the group, or a rank that is not a member of the group used."""


class NotInitialized(FerrodistError, RuntimeError):
    """No default process group: call ``init_process_group`` first."""


class BackendUnavailable(FerrodistError, RuntimeError):
    """A backend whose package or library is not installed or cannot load."""


class DeviceUnavailable(FerrodistError, RuntimeError):
    """A device (a CUDA GPU) that this machine or installation cannot provide."""


class CollectiveTimeout(FerrodistError, TimeoutError):
    """A blocking call ran out of time.

    Attributes:
        waiting_for: the ranks this rank was still waiting for (global ranks), if known.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        operation: str | None = None,
        waiting_for: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message, rank=rank, operation=operation)
        self.waiting_for = tuple(waiting_for)


class PeerLost(FerrodistError, ConnectionError):
    """A peer rank went away (closed, crashed, killed) while this rank needed it.

    Attributes:
        peer: the global rank that was lost.
        finished: the peer closed its transport on purpose (it finished, or destroyed its
            group) rather than failing.
    """

    def __init__(
        self,
        message: str,
        *,
        peer: int,
        rank: int | None = None,
        operation: str | None = None,
        finished: bool = False,
    ) -> None:
        super().__init__(message, rank=rank, operation=operation)
        self.peer = peer
        self.finished = finished


class ProtocolError(FerrodistError, RuntimeError):
    """Bytes on the wire that do not follow the protocol (a malformed or foreign frame)."""


class CollectiveMismatch(FerrodistError, RuntimeError):
    """Ranks disagree about the call: a different operation, size, dtype, op or root.

    Attributes:
        peer: the rank whose message did not match, when known.
        expected: this rank's call fingerprint (0 when not known).
        received: the peer's call fingerprint (0 when not known).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        operation: str | None = None,
        peer: int | None = None,
        expected: int = 0,
        received: int = 0,
    ) -> None:
        super().__init__(message, rank=rank, operation=operation)
        self.peer = peer
        self.expected = expected
        self.received = received


class GroupAborted(FerrodistError, RuntimeError):
    """A call on a group that an earlier failed collective aborted (on this rank or another).

    A failed collective aborts its group on every rank, so that no rank goes on with calls
    that the others gave up: every later call on it raises this at once, naming the first
    failure, until the group is made again (``new_group``, or ``destroy_process_group`` and
    ``init_process_group`` for the world).

    Attributes:
        cause: the error of the collective that failed first.
    """

    def __init__(self, message: str, *, cause: FerrodistError, rank: int | None = None, operation: str | None = None):
        super().__init__(message, rank=rank, operation=operation)
        self.cause = cause


class Excluded(FerrodistError, RuntimeError):
    """This rank is not in the group its peers shrank to (``ProcessGroup.shrink``): it was
    silent while they agreed on who is live, or it found no majority of the members to
    agree with. The others, if there are any, went on without it; this process should
    exit (a launcher that keeps the job running may start a replacement).

    Attributes:
        survivors: the global ranks of the group the others made, when known (empty when
            this rank could not learn it).
    """

    def __init__(
        self,
        message: str,
        *,
        survivors: tuple[int, ...] = (),
        rank: int | None = None,
        operation: str | None = None,
    ) -> None:
        super().__init__(message, rank=rank, operation=operation)
        self.survivors = tuple(survivors)


class AuthenticationFailed(FerrodistError, PermissionError):
    """A connection whose other end does not hold this job's token (``FERRODIST_TOKEN``)."""


# Tracebacks and pickles name the public module, not this private one.
for _cls in (
    FerrodistError,
    InvalidArgument,
    InvalidRank,
    NotInitialized,
    BackendUnavailable,
    DeviceUnavailable,
    CollectiveTimeout,
    PeerLost,
    ProtocolError,
    CollectiveMismatch,
    GroupAborted,
    Excluded,
    AuthenticationFailed,
):
    _cls.__module__ = "ferrodist.core"
