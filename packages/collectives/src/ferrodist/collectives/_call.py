"""One collective call in flight: its tag, its deadline, its peers and its scratch space.

Algorithms talk to peers by *group* rank through a ``Call``; the call turns those into
transport ranks, keeps every wait within the call's deadline, and keeps the call's
messages apart from every other call's (each call has its own tag).
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ferrodist.core import CollectiveTimeout, FerrodistError
from ferrodist.transport import Request, Transport

Array = np.ndarray[Any, Any]
#: A kernel from ferrodist.core.reducer: fn(dst, srcs, divisor).
Reducer = Callable[[Array, Sequence[Array], float], None]

# Transport tag layout: [group id][1 bit: collective][31 bits: call number or user tag].
# The operation is not in the tag: it travels in the fingerprint, so ranks in different
# collectives match each other's messages and the receiver reports the mismatch at once.
_SEQ_BITS = 31
_COLLECTIVE_BIT = 1 << _SEQ_BITS
_GROUP_SHIFT = _SEQ_BITS + 1
MAX_USER_TAG = (1 << _SEQ_BITS) - 1
_TOKEN = np.zeros(1, np.uint8)
_AGREE = 6  # the scratch slot of ``Call.agree``
_SUBGROUPS = 1 << 30


def collective_tag(group_id: int, seq: int) -> int:
    """The transport tag of collective call number ``seq`` on a group."""
    return (group_id << _GROUP_SHIFT) | _COLLECTIVE_BIT | (seq & MAX_USER_TAG)


def subgroup_channel(name: str) -> int:
    """The group id of a subgroup made by its members only (``ProcessGroup.subgroup``),
    derived from its name: bit 30 set, apart from the small ids ``new_group`` counts up."""
    return _SUBGROUPS | (zlib.crc32(name.encode()) & (_SUBGROUPS - 1))


def p2p_tag(group_id: int, tag: int) -> int:
    """The transport tag of a user's point-to-point message with ``tag`` on a group."""
    return (group_id << _GROUP_SHIFT) | tag


class Scratch:
    """Reusable byte buffers, one set per thread (calls run in the caller's thread or a
    group's async worker). A buffer only grows; it is never allocated per step."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, slot: int, count: int, dtype: np.dtype[Any]) -> Array:
        buffers: dict[int, Array] = self._local.__dict__.setdefault("buffers", {})
        nbytes = count * dtype.itemsize
        buf = buffers.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(max(nbytes, 64), np.uint8)
            buffers[slot] = buf
        return buf[:nbytes].view(dtype)


@dataclass
class Call:
    """The context one algorithm runs in."""

    transport: Transport
    ranks: Sequence[int]  # group rank -> transport rank
    rank: int  # this rank, in the group
    tag: int
    deadline: float
    scratch: Scratch
    fingerprint: int = 0
    seq: int = 0  # the call's number on its group

    @property
    def size(self) -> int:
        return len(self.ranks)

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise CollectiveTimeout("the call ran out of time before its next step", rank=self.ranks[self.rank])
        return left

    def isend(self, buf: Array, peer: int) -> Request:
        return self.transport.isend(buf, self.ranks[peer], self.tag, fingerprint=self.fingerprint)

    def irecv(self, buf: Array, peer: int) -> Request:
        return self.transport.irecv(buf, self.ranks[peer], self.tag, fingerprint=self.fingerprint)

    def send(self, buf: Array, peer: int) -> None:
        self.transport.send(buf, self.ranks[peer], self.tag, timeout=self.remaining(), fingerprint=self.fingerprint)

    def recv(self, buf: Array, peer: int) -> None:
        self.transport.recv(buf, self.ranks[peer], self.tag, timeout=self.remaining(), fingerprint=self.fingerprint)

    def wait(self, request: Request) -> None:
        request.wait(self.remaining())

    def wait_all(self, requests: Sequence[Request]) -> None:
        for request in requests:
            request.wait(self.remaining())

    def exchange(self, send_buf: Array, to: int, recv_buf: Array, frm: int) -> None:
        """Send to one peer and receive from another at the same time (one ring step).

        The receive is posted first, so that a transport can put the incoming bytes
        straight into ``recv_buf`` while the send is going out. A transport with its own
        ``sendrecv`` (tcp) does the step itself.
        """
        self.transport.sendrecv(
            send_buf,
            self.ranks[to],
            recv_buf,
            self.ranks[frm],
            self.tag,
            timeout=self.remaining(),
            fingerprint=self.fingerprint,
        )

    def aborted(self) -> FerrodistError | None:
        """The error this call's group was aborted with (here or by a peer), or None."""
        return self.transport.aborted(self.tag >> _GROUP_SHIFT)

    def agree(self) -> None:
        """Check, with one small message per rank, that the ranks are in the same call.

        Each rank tells the next one (in a ring) which call it is in and hears from the
        previous one, so if any two ranks differ, some rank sees it and raises; its abort
        then fails the call everywhere. Run first by the rooted collectives, where some
        ranks would otherwise only send (ranks naming different roots would each return
        their own data) or only wait (each for another).
        """
        if self.size == 1:
            return
        token = self.scratch.get(_AGREE, 1, np.dtype(np.uint8))
        incoming = self.irecv(token, (self.rank - 1) % self.size)
        self.wait(self.isend(_TOKEN, (self.rank + 1) % self.size))
        self.wait(incoming)
