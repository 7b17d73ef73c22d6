"""A TCP transport's connection to one peer (``Link``), which owns everything of that peer,
as Gloo's ``pair`` does: the socket and its frames both ways (``Framing``, Python and
compiled), who reads them, the matching of the peer's messages to their receives (its
``Mailbox``), the waits for them, and the path a ``sendrecv`` takes. What it shares with
the transport's other links (the condition its waiters sleep on, the aborted channels, the
peers that are gone, the receives from any of several senders) is the ``Context`` the
transport hands it, with the other links themselves.

The socket is read by whoever holds the reader: the link's own thread, or a caller waiting
for a message from this peer, which reads the frames itself (the hand-off from a reader
thread cost more than the transfer of a small message).
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping

from ferrodist.core import CollectiveTimeout, FerrodistError, PeerLost, ProtocolError
from ferrodist.core.kernels import Twin
from ferrodist.transport._aborts import channel_of, decode_notice, departure, fresh
from ferrodist.transport._checks import Buffer, check_match
from ferrodist.transport._frames import ABORT, DATA, GOODBYE

from . import compiled
from .context import Context
from .framing import DIRECT_OTHER, DIRECT_WAIT, LOOK, Framing
from .mailbox import Mailbox
from .records import Frame, Pending

__all__ = ["DIRECT", "Link"]

#: A sendrecv's messages up to this size (both ways) are read straight into their buffer.
DIRECT = 64 << 10
#: Seconds a link stays with the callers after their last claim before its thread reads it again.
_LINGER = 0.005
#: Seconds a failed send spends reading what the peer sent last (its notice, its reason for leaving).
_LAST_WORDS = 0.2


class Link:
    """The connection to one peer: its frames, its reader thread, its mailbox.

    Frames are read by whoever holds ``framing.read_lock``, a piece at a time
    (``advance``). While callers have the link (``claim``), it is out of the thread's epoll
    set and the thread sleeps on; a send that waits for room reads such links meanwhile
    (``_room``). A reader stops wherever the bytes stop, mid-frame included, and the next
    one goes on from there: no reader ever waits for a peer while that peer waits for it.

    ``context``: what the transport's links share; ``links``: every link of the transport,
    this one included (a send that waits for room reads those that callers hold).
    """

    def __init__(self, peer: int, sock: socket.socket, context: Context, links: Mapping[int, Link]) -> None:
        self.context = context
        self.peer = peer
        self.links = links
        self.sock = sock
        self.framing = Framing(
            sock,
            context.rank,
            peer,
            context.max_frame,
            self._begin_data,
            self._complete,
            self._room,
            context.frames.missed,
        )
        # A small sendrecv with this peer both ways: one compiled call, or its twin in Python
        # (send, then read straight into the buffer).
        self._exchange: Callable[[Buffer, Pending, float], bool] = self._send_then_take
        if compiled.AVAILABLE:
            self._exchange = Twin(self.exchange, self._send_then_take, queue=context.frames.missed).call
        self.mailbox = Mailbox(context.rank, peer, context.mailboxes)
        self.claim_lock = threading.Lock()
        self.claims = 0  # callers reading this link themselves; the thread reads when none
        self.sleepers = 0  # callers sleeping until the reader is free (guarded by context.cond)
        self.paused = False  # the thread is not listening (claimed now, or a moment ago)
        self.released = 0.0  # when the last claim ended
        self.ended = False  # no more frames will be read: GOODBYE, a broken stream, or close
        self.farewell = False  # this rank has said goodbye on it
        self._events = select.epoll()
        self._events.register(self.framing.fd, select.EPOLLIN)
        # Wakes the thread from a long sleep when a caller claims the link: the thread would
        # otherwise sleep its second out with the socket no longer in its set, and a message
        # that comes after the caller is done would wait that long for a reader.
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._events.register(self._wake, select.EPOLLIN)
        self.listening = False  # the thread is in (or about to enter) a long sleep listening
        self.thread = threading.Thread(
            target=self._receive_loop, name=f"ferrodist-rank{context.rank}-from{peer}", daemon=True
        )

    # -- who reads --------------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        """The link's thread: read what has arrived whenever no caller has the link."""
        while not self.ended:
            ready = self._events.poll(self._resume())
            self.listening = False
            if any(fd == self._wake for fd, _ in ready):
                try:
                    os.eventfd_read(self._wake)
                except BlockingIOError:
                    pass
                continue  # claimed: sleep on the short naps of ``_resume``
            if not ready and not self.context.closing:
                continue
            self.framing.read_lock.acquire()
            try:
                while not self.ended and self.advance(None):
                    pass
            finally:
                self.let_go()

    def claim(self) -> None:
        """A caller will read this link itself (see ``read_for``): the thread sleeps on."""
        with self.claim_lock:
            self.claims += 1
            if not self.paused:
                self.paused = True
                self._listen(0)
                if self.listening:
                    os.eventfd_write(self._wake, 1)

    def unclaim(self) -> None:
        """The caller is done. The thread takes the link back only after ``_LINGER`` idle
        seconds (see ``_resume``): a caller making call after call keeps it all along, and
        its peer's next message, often already on its way, is not read by the thread."""
        with self.claim_lock:
            self.claims -= 1
            if self.claims == 0:
                self.released = time.monotonic()

    def _resume(self) -> float:
        """The thread's check before it sleeps: take the link back if nobody has claimed it
        for ``_LINGER`` seconds. Returns how long to sleep before looking again (ten times
        that while a caller holds the link: a long ``recv`` should not wake it 200 times a
        second)."""
        with self.claim_lock:
            if not self.paused:
                self.listening = True
                return 1.0
            if self.claims:  # a caller reads it now (perhaps for long): look again later
                return 10 * _LINGER
            idle = time.monotonic() - self.released
            if idle < _LINGER:
                return _LINGER - idle
            self.paused = False
            self._listen(select.EPOLLIN)
            self.listening = True
            return 1.0

    def _listen(self, events: int) -> None:
        if not self.ended:
            try:
                self._events.modify(self.framing.fd, events)
            except (OSError, ValueError):  # closed under us: the waits report why
                pass

    def read_for(self, pending: Pending, deadline: float) -> None:
        """A caller's wait, on a claimed link: until ``pending`` is done, the deadline passes
        or the link ends, read the link's frames, or, while another thread holds the
        reader, sleep on the links' condition. The holder delivers every frame (this
        one's too: each completion wakes the sleepers) and wakes them when it lets go, so
        one of them takes over; a waiter whose message has come never waits on the
        reader, which may be waiting for a message that depends on this one's reply."""
        cond, read_lock = self.context.cond, self.framing.read_lock
        if not read_lock.acquire(blocking=False):
            with cond:
                self.sleepers += 1  # before the retry: a holder letting go now sees it
                try:
                    while not read_lock.acquire(blocking=False):
                        if pending.done or self.ended:
                            return
                        left = deadline - time.monotonic()
                        if left <= 0:
                            return
                        cond.wait(left)
                finally:
                    self.sleepers -= 1
        aborts, channel = self.context.aborts, channel_of(pending.tag)
        yields = self.context.yields
        try:
            # An abort stops the wait, except for a message that has begun to arrive: nobody
            # else reads this link now, and the rest (or the end of a dead peer's stream) must
            # be read for the receive to end before its deadline.
            while not pending.done and not self.ended and (pending.claimed or aborts.error(channel) is None):
                if not self.advance(deadline):
                    if yields:  # ranks outnumber the cores: the sender may be waiting for this one
                        yields -= 1
                        os.sched_yield()
                        continue
                    # A notice that aborts this wait may come on another link: look every 50 ms.
                    if not self.framing.wait(self.framing.readable, min(deadline, time.monotonic() + LOOK)):
                        if time.monotonic() >= deadline:
                            return
        finally:
            self.let_go()

    def let_go(self) -> None:
        """Release the reader and wake the callers sleeping on it (see ``read_for``)."""
        self.framing.read_lock.release()
        if self.sleepers:
            with self.context.cond:
                self.context.cond.notify_all()

    def advance(self, deadline: float | None) -> bool:
        """Read what has arrived, up to the end of one frame, and deliver a frame that is
        complete (the caller holds the reader). True if any bytes came. A failure ends the
        link and is recorded against the peer and the receive being filled."""
        try:
            return self.framing.read()
        except Exception as exc:
            self._failed(exc)
        return False

    def _failed(self, exc: Exception) -> None:
        """Reading failed with ``exc``: end the link, with the error its receives get."""
        rank = self.context.rank
        if isinstance(exc, FerrodistError):
            self._end(exc)
        elif isinstance(exc, EOFError):
            if self.context.closing:
                self._end(PeerLost("this transport is closing", peer=self.peer))
            else:
                self._end(
                    PeerLost(
                        f"rank {self.peer} went away without closing its transport (it exited, crashed or was killed)",
                        peer=self.peer,
                        rank=rank,
                    )
                )
        elif isinstance(exc, OSError):
            self._end(
                PeerLost(
                    f"the connection from rank {self.peer} broke ({exc.strerror or exc}): it died or was killed",
                    peer=self.peer,
                    rank=rank,
                )
            )
        else:
            self._end(ProtocolError(f"reading from rank {self.peer} failed: {exc!r}", rank=rank))

    def _end(self, error: FerrodistError) -> None:
        """No more frames: the peer, and the receive being filled from it, fail with ``error``."""
        self.ended = True
        frame, self.framing.frame = self.framing.frame, None
        taker = None if frame is None else frame.pending if frame.arrival is None else frame.arrival.taker
        self.context.lose(self.peer, error, taker)

    # -- where the peer's messages go ---------------------------------------------------------------
    def _begin_data(self, tag: int, fingerprint: int, length: int) -> Frame:
        """A DATA frame's header has arrived: its payload goes into the receive posted for it,
        into an arrival kept until its receive is posted, or (its channel aborted, or it does
        not fit its receive) through a scratch buffer."""
        context = self.context
        if context.aborts.error(channel_of(tag)) is not None:  # read and dropped: nobody will take it
            frame = Frame(tag, fingerprint, None, None)
            frame.left = length
            frame.next_piece()
            return frame
        with context.cond:
            pending, arrival = self.mailbox.arriving(tag, fingerprint, length)
        frame = Frame(tag, fingerprint, pending, None)
        if pending is None:
            frame.arrival = arrival
            frame.left = length
            frame.next_piece()
            return frame
        frame.error = check_match(
            context.rank, self.peer, tag, pending.buf.nbytes, pending.fingerprint, length, fingerprint
        )
        if frame.error is None:
            frame.piece = memoryview(pending.buf).cast("B")  # type: ignore[arg-type]
        else:
            frame.left = length
            frame.next_piece()
        return frame

    def _complete(self, frame: Frame) -> None:
        """The last byte of ``frame`` has arrived: finish its receive, or keep it for one; a
        notice aborts its channel, a goodbye ends the link."""
        context = self.context
        if frame.kind == ABORT:
            seq, error = decode_notice(bytes(frame.payload or b""), context.rank, self.peer)
            context.abort_here(frame.tag, error, heard=(self.peer, seq))  # an ABORT frame's tag is the channel
            return
        if frame.kind == GOODBYE:
            self._end(departure(context.rank, self.peer, bytes(frame.payload or b"")))
            return
        arrival = frame.arrival
        if arrival is not None:
            with context.cond:
                arrival.done = True
                if arrival.taker is not None:  # its receive was posted while the bytes were arriving
                    self.mailbox.fill(arrival.taker, arrival)
                    context.cond.notify_all()
            return
        pending = frame.pending
        if pending is None:
            return  # a dropped frame of an aborted channel
        with context.cond:
            pending.error = frame.error
            pending.done = True
            context.cond.notify_all()

    def post(self, pending: Pending) -> None:
        """Post a receive of this peer's message (``irecv``): matched with one kept for it,
        else queued; failed at once if its channel is aborted."""
        context = self.context
        with context.cond:
            if not context.refuse(pending):
                self.mailbox.post(pending)

    def wait(self, pending: Pending, limit: float, *, claimed: bool = False) -> None:
        """Wait up to ``limit`` seconds for ``pending``, a posted receive of this peer's
        message, reading this link itself (``claimed``: the caller has claimed it already);
        raise what ended it."""
        deadline = time.monotonic() + limit
        if not pending.done and not self.ended:
            if claimed:
                self.read_for(pending, deadline)
            else:
                self.claim()
                try:
                    self.read_for(pending, deadline)
                finally:
                    self.unclaim()
        if pending.done:  # the common case: no lock to take
            if pending.error is not None:
                raise pending.error
            return
        self.context.wait(pending, limit, deadline)

    # -- a ring step --------------------------------------------------------------------------------
    def sendrecv(self, payload: Buffer, to: Link, pending: Pending, limit: float) -> None:
        """Send ``payload`` on ``to`` (this link or another) and receive ``pending`` from this
        peer (one ring step), within ``limit`` seconds. The caller reads this link itself for
        the whole call, also while its send waits for room, so no thread hand-off delays the
        reply. The path: with the same peer both ways and up to ``DIRECT`` bytes each way, one
        compiled call sends and reads (``exchange``); else a small step sends first and then
        reads its message straight into its buffer (``take``); a large one posts its receive
        first, so that what comes while its send waits for room lands in the buffer (``_room``),
        not in a kept copy."""
        deadline = time.monotonic() + limit
        tag, fingerprint = pending.tag, pending.fingerprint
        direct = pending.buf.nbytes <= DIRECT and payload.nbytes <= DIRECT
        self.claim()
        try:
            if not direct:
                self.post(pending)
                to.send_message(payload, tag, fingerprint, max(0.0, deadline - time.monotonic()))
            elif to is not self or not self._exchange(payload, pending, limit):
                to.send_message(payload, tag, fingerprint, max(0.0, deadline - time.monotonic()))
                self.take(pending, deadline)
            if not pending.done or pending.error is not None:
                self.wait(pending, max(0.0, deadline - time.monotonic()), claimed=True)
        finally:
            self.unclaim()

    def read_direct(self, pending: Pending, deadline: float) -> int:
        """``Framing.read_direct`` with this link's yields; a connection that fails ends the
        link (``DIRECT_WAIT`` then: the general reader reports it)."""
        try:
            return self.framing.read_direct(pending, deadline, self.context.yields)
        except OSError as exc:
            self._failed(exc)
        return DIRECT_WAIT

    def take(self, pending: Pending, deadline: float) -> None:
        """The receive of a ``sendrecv`` on this claimed link: read its message straight into
        its buffer where nothing can be in the way (``read_direct``), else post it as
        ``irecv`` does (a message that came meanwhile was kept for it) for the general
        reader (``read_for``)."""
        if self.ended or not self.framing.read_lock.acquire(blocking=False):
            self.post(pending)
            return
        try:
            self._settle(pending, self.read_direct(pending, deadline) if self._clear(pending.tag) else DIRECT_WAIT)
        finally:
            self.let_go()

    def exchange(self, payload: Buffer, pending: Pending, limit: float) -> bool:
        """A small ``sendrecv`` with this peer both ways, on the claimed link: the frame out
        and, where nothing can be in the way (as in ``take``), pending's message read into
        its buffer, in one compiled call (``Framing.exchange``); what that leaves undone goes
        on as ``send_message`` and ``take`` would. False: nothing was sent (the link is not
        clear), the caller sends and takes as usual. Raises ``NotCompiled`` before anything
        is sent where the code is not loaded (its twin is ``_send_then_take``), and what
        ``send_message`` raises."""
        self._check_open(pending.tag)
        framing, deadline = self.framing, time.monotonic() + limit
        try:
            with framing.send_lock:
                if self.ended or not framing.read_lock.acquire(blocking=False):
                    return False
                try:
                    if not self._clear(pending.tag):
                        return False
                    result = framing.exchange(payload, pending, self.context.yields)
                    status = result & 7
                    if status == compiled.DONE:  # the common case
                        return True
                    if status != compiled.WAIT and status != compiled.UNSENT:
                        try:
                            outcome = framing.read_compiled(pending, deadline, self.context.yields, result)
                        except OSError as exc:
                            self._failed(exc)
                            outcome = DIRECT_WAIT
                        self._settle(pending, outcome)
                        return True
                finally:
                    self.let_go()
                if status == compiled.UNSENT:
                    framing.finish_exchange(payload, deadline)
            self.take(pending, deadline)  # not here yet: waited for without the send lock
            return True
        except OSError as exc:
            raise self._send_failed(exc, pending.tag, payload.nbytes, limit) from None

    def _send_then_take(self, payload: Buffer, pending: Pending, limit: float) -> bool:
        """``exchange``'s steps in Python: the message out, then pending's read straight into
        its buffer where nothing is in the way (``take``)."""
        deadline = time.monotonic() + limit
        self.send_message(payload, pending.tag, pending.fingerprint, limit)
        self.take(pending, deadline)
        return True

    def _clear(self, tag: int) -> bool:
        """Nothing can come before the message of ``tag`` on this link: no frame begun, no
        abort of its channel, no receive or kept message of its tag, the peer not lost (the
        caller holds the reader; the dicts other threads change only under the links'
        condition, each read as atomic as the GIL makes it)."""
        context = self.context
        return (
            self.framing.frame is None
            and context.aborts.error(channel_of(tag)) is None
            and self.mailbox.quiet(tag)
            and self.peer not in context.lost
        )

    def _settle(self, pending: Pending, outcome: int) -> None:
        """After a direct read (the caller holds the reader): post pending for the general
        reader unless it is filled or its frame is the one being read now; begin the frame
        of another message whose header is in."""
        if outcome == DIRECT_WAIT or outcome == DIRECT_OTHER:
            self.post(pending)
        if outcome == DIRECT_OTHER:  # a whole header is in: begin its frame as advance would
            try:
                self.framing.begin_next()
            except Exception as exc:
                self._failed(exc)

    # -- sending (any thread, one frame at a time) ----------------------------------------------------
    def send(self, kind: int, tag: int, fingerprint: int, payload: Buffer | None, timeout: float) -> None:
        """Send one frame (``Framing.send``). Raises ``TimeoutError`` when the peer does not
        take the bytes in time, ``OSError`` when the connection broke."""
        self.framing.send(kind, tag, fingerprint, payload, timeout)

    def send_message(self, payload: Buffer, tag: int, fingerprint: int, limit: float) -> None:
        """Send one message to this peer (``isend``), within ``limit`` seconds. Raises what
        stops it: its channel's abort, this rank's stop or the peer's loss, a peer that does
        not take the bytes in time (``CollectiveTimeout``; the link is unusable then), or a
        broken connection (``PeerLost``, or the failure the peer reported before it left)."""
        self._check_open(tag)
        try:
            self.framing.send(DATA, tag, fingerprint, payload, limit)
        except OSError as exc:
            raise self._send_failed(exc, tag, payload.nbytes, limit) from None

    def _check_open(self, tag: int) -> None:
        context = self.context
        lost = context.aborts.error(channel_of(tag)) or context.lost.get(context.rank) or context.lost.get(self.peer)
        if lost is not None:
            raise fresh(lost, f"rank {context.rank} cannot send to rank {self.peer}")

    def _send_failed(self, exc: OSError, tag: int, nbytes: int, limit: float) -> FerrodistError:
        """The error of a send that failed with ``exc``; the link is given up."""
        context, rank, peer = self.context, self.context.rank, self.peer
        if isinstance(exc, TimeoutError):
            stalled = CollectiveTimeout(
                f"rank {rank} could not hand {nbytes} bytes to rank {peer} within {limit:g} s: "
                f"rank {peer} is not reading (stopped or overloaded)",
                rank=rank,
                waiting_for=(peer,),
            )
            context.lose(peer, stalled)  # a frame was cut in the middle: this connection is unusable now
            return stalled
        said = self.last_words(channel_of(tag))
        if said is not None:  # it left because of a failure it told us about: report that
            return fresh(said, f"rank {rank} cannot send to rank {peer}")
        error = PeerLost(
            f"rank {rank} cannot send to rank {peer}: the connection broke ({exc.strerror or exc}); it died or "
            "was killed",
            peer=peer,
            rank=rank,
        )
        context.lose(peer, error)
        return error

    def last_words(self, channel: int) -> FerrodistError | None:
        """After a send to this peer broke: read the frames it sent before it left, if they
        are still unread (an abort notice, a departure with its reason), and return the
        failure they name, as a receive would have reported it; None if they name none."""
        context = self.context
        if self.framing.read_lock.acquire(timeout=_LAST_WORDS):  # the link's thread may be reading them now
            try:
                give_up = time.monotonic() + _LAST_WORDS
                while not self.ended and time.monotonic() < give_up and self.advance(give_up):
                    pass
            finally:
                self.let_go()
        with context.cond:
            return context.aborts.error(channel) or context.lost.get(self.peer)

    def _room(self, deadline: float) -> bool:
        """A send on this link waits for room: meanwhile read what has arrived on the links
        callers hold (their threads are not reading them), so that two ranks sending to each
        other cannot block each other. False once ``deadline`` has passed."""
        held = [link for link in self.links.values() if link.paused and not link.ended]
        if not held:
            return self.framing.wait(self.framing.writable, deadline)
        masks = {self.framing.fd: select.POLLOUT}
        for link in held:
            masks[link.framing.fd] = masks.get(link.framing.fd, 0) | select.POLLIN
        poller = select.poll()
        for fd, mask in masks.items():
            poller.register(fd, mask)
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        ready = {fd for fd, events in poller.poll(min(left, 1.0) * 1000 + 1) if events & ~select.POLLOUT}
        for link in held:
            if link.framing.fd in ready and link.framing.read_lock.acquire(blocking=False):
                try:
                    while not link.ended and link.advance(deadline):
                        pass
                finally:
                    link.let_go()
        return True

    def close(self, deadline: float) -> None:
        """After the socket's shutdown: wait until ``deadline`` for the link's thread to end,
        then close the socket (and the thread's epoll set, once the thread has ended)."""
        if self.thread.is_alive():
            self.thread.join(max(0.0, deadline - time.monotonic()))
        if not self.thread.is_alive():
            self._events.close()
            os.close(self._wake)
        self.sock.close()
