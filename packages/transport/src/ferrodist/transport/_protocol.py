"""The ``Transport`` protocol: how ranks move bytes. Every blocking call takes a timeout."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["DEFAULT_TIMEOUT", "Request", "Transport"]

#: Seconds a blocking call waits when neither the call nor the transport says otherwise.
DEFAULT_TIMEOUT = 300.0

Buffer = np.ndarray[Any, Any]


@runtime_checkable
class Request(Protocol):
    """A send or receive in flight."""

    def wait(self, timeout: float | None = None) -> None:
        """Block until done (``timeout`` seconds at most, the transport's timeout if ``None``).

        Raises the transfer's error (``PeerLost``, ``CollectiveMismatch``, ...) or
        ``CollectiveTimeout`` naming the peer that did not arrive.
        """
        ...

    def is_completed(self) -> bool:
        """True once the transfer finished, successfully or not (never blocks)."""
        ...


@runtime_checkable
class Transport(Protocol):
    """Point-to-point byte movement between the ranks of one job.

    Buffers are C-contiguous numpy arrays (any dtype; their bytes are moved).
    Messages between a pair of ranks are matched by ``(source, tag)`` in the order
    they were sent. A receive names the exact byte count it expects (the size of its
    buffer); a message of another size is a ``CollectiveMismatch``.

    A send and a receive may each carry a ``fingerprint``, a non-zero integer that
    describes the call they belong to. When both are non-zero and differ, the receive
    fails with ``CollectiveMismatch`` (``expected`` = the receiver's, ``received`` = the
    sender's) and its buffer is left untouched.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def timeout(self) -> float:
        """Default seconds for blocking calls."""
        ...

    def send(
        self, buf: Buffer, dst: int, tag: int = 0, *, timeout: float | None = None, fingerprint: int = 0
    ) -> None: ...

    def recv(
        self, buf: Buffer, src: int, tag: int = 0, *, timeout: float | None = None, fingerprint: int = 0
    ) -> None: ...

    def isend(self, buf: Buffer, dst: int, tag: int = 0, *, fingerprint: int = 0) -> Request: ...

    def irecv(self, buf: Buffer, src: int, tag: int = 0, *, fingerprint: int = 0) -> Request: ...

    def barrier(self, *, timeout: float | None = None) -> None: ...

    def close(self) -> None: ...
