"""A TCP transport's connection to one peer (``Link``).

What a frame's header announces is not reserved before its bytes come (see ``records``);
an abort notice or a goodbye is read whole, but announcing more than ``NOTICE_LIMIT`` bytes
is a ``ProtocolError``.

The link's socket is non-blocking and its reader resumable: whoever holds its read lock
reads, a piece at a time, the link's own thread or a caller waiting for a message from
this peer. ``TcpTransport`` (``_tcp``) owns the links and the matching of messages to
receives; a link calls back into it for that (``_begin``, ``_complete``, ``_lose``).
A frame of up to 64 KiB is sent, and a direct read done, by compiled code (``compiled``).
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from ferrodist.core import FerrodistError, PeerLost, ProtocolError
from ferrodist.transport._aborts import channel_of
from ferrodist.transport._checks import Buffer
from ferrodist.transport._frames import (
    ABORT,
    DATA,
    GOODBYE,
    HEADER,
    HELLO,
    MAGIC,
    PROTOCOL_VERSION,
    decode_header,
    encode_header,
)

from . import compiled
from .records import Frame, Pending

if TYPE_CHECKING:
    from .transport import TcpTransport

__all__ = ["DIRECT_DONE", "DIRECT_OTHER", "DIRECT_PAYLOAD", "DIRECT_WAIT", "NOTICE_LIMIT", "Link"]

_SMALL = 64 << 10  # payloads up to this size go out in one write with their header
#: The most bytes an abort notice or a goodbye's reason may take (a JSON error: a few KiB).
NOTICE_LIMIT = 1 << 20
#: Seconds a link stays with the callers after their last claim before its thread reads it again.
_LINGER = 0.005
#: Seconds between a reading caller's looks at the aborted channels (notices may come on other links).
_LOOK = 0.05
#: Seconds a failed send spends reading what the peer sent last (its notice, its reason for leaving).
_LAST_WORDS = 0.2
#: What ``Link.read_direct`` did.
DIRECT_DONE, DIRECT_WAIT, DIRECT_OTHER, DIRECT_PAYLOAD = range(4)
_DATA_WORD = compiled.first_word(DATA)
_WORDS = {kind: compiled.first_word(kind) for kind in (DATA, HELLO, GOODBYE, ABORT)}


class Link:
    """The connection to one peer: a send lock and sequence, and a resumable reader.

    The socket is non-blocking; every wait is a ``poll`` with a deadline. Frames are read
    by whoever holds ``read_lock``, a piece at a time (``advance``): the link's own thread,
    or a caller waiting for a message from this peer, which reads the frames itself (the
    hand-off from a reader thread cost more than the transfer of a small message). While
    callers have the link (``claim``), it is out of the thread's epoll set and the thread
    sleeps on; a send that waits for room reads such links meanwhile (``_room``). A
    reader stops wherever the bytes stop, mid-frame included, and the next one goes on
    from there: no reader ever waits for a peer while that peer waits for it. A
    ``sendrecv`` whose message is the link's next frame reads it straight into its buffer,
    past the mailbox (``take``).
    """

    def __init__(self, transport: TcpTransport, peer: int, sock: socket.socket) -> None:
        self.transport = transport
        self.peer = peer
        self.sock = sock
        sock.setblocking(False)
        self.fd = sock.fileno()
        self.send_lock = threading.Lock()
        self.send_seq = 1  # HELLO was frame 0 in both directions
        self.recv_seq = 1
        self.read_lock = threading.Lock()
        self.claim_lock = threading.Lock()
        self.claims = 0  # callers reading this link themselves; the thread reads when none
        self.sleepers = 0  # callers sleeping until the reader is free (guarded by transport._cond)
        self.paused = False  # the thread is not listening (claimed now, or a moment ago)
        self.released = 0.0  # when the last claim ended
        self.ended = False  # no more frames will be read: GOODBYE, a broken stream, or close
        self.farewell = False  # this rank has said goodbye on it
        # the frame being read (guarded by read_lock)
        self._head = np.zeros(HEADER.size, np.uint8)
        self._header = memoryview(self._head)  # type: ignore[arg-type]
        self._words = np.zeros(compiled.HEADER_WORDS, np.int64)  # the header being sent (send_lock)
        self._words_bytes = memoryview(self._words).cast("B")  # type: ignore[arg-type]
        self._message = np.zeros(compiled.MSG_WORDS, np.uint64)
        self._got = 0  # bytes of the header, then of the current piece of payload
        self._frame: Frame | None = None
        self._readable = select.poll()
        self._readable.register(self.fd, select.POLLIN)
        self._writable = select.poll()
        self._writable.register(self.fd, select.POLLOUT)
        self._events = select.epoll()
        self._events.register(self.fd, select.EPOLLIN)
        self.thread = threading.Thread(
            target=self._receive_loop, name=f"ferrodist-rank{transport.rank}-from{peer}", daemon=True
        )

    # -- receiving ------------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        """The link's thread: read what has arrived whenever no caller has the link."""
        while not self.ended:
            if not self._events.poll(self._resume()) and not self.transport._closing:
                continue
            self.read_lock.acquire()
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
        if not self.paused:
            return 1.0
        with self.claim_lock:
            if self.claims:  # a caller reads it now (perhaps for long): look again later
                return 10 * _LINGER
            idle = time.monotonic() - self.released
            if idle < _LINGER:
                return _LINGER - idle
            self.paused = False
            self._listen(select.EPOLLIN)
            return 1.0

    def _listen(self, events: int) -> None:
        if not self.ended:
            try:
                self._events.modify(self.fd, events)
            except (OSError, ValueError):  # closed under us: the waits report why
                pass

    def read_for(self, pending: Pending, deadline: float) -> None:
        """A caller's wait, on a claimed link: until ``pending`` is done, the deadline passes
        or the link ends, read the link's frames, or, while another thread holds the
        reader, sleep on the transport's condition. The holder delivers every frame (this
        one's too: each completion wakes the sleepers) and wakes them when it lets go, so
        one of them takes over; a waiter whose message has come never waits on the
        reader, which may be waiting for a message that depends on this one's reply."""
        cond = self.transport._cond
        if not self.read_lock.acquire(blocking=False):
            with cond:
                self.sleepers += 1  # before the retry: a holder letting go now sees it
                try:
                    while not self.read_lock.acquire(blocking=False):
                        if pending.done or self.ended:
                            return
                        left = deadline - time.monotonic()
                        if left <= 0:
                            return
                        cond.wait(left)
                finally:
                    self.sleepers -= 1
        aborts, channel = self.transport._aborts, channel_of(pending.tag)
        yields = self.transport.yields
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
                    if not self._wait(self._readable, min(deadline, time.monotonic() + _LOOK)):
                        if time.monotonic() >= deadline:
                            return
        finally:
            self.let_go()

    def let_go(self) -> None:
        """Release the reader and wake the callers sleeping on it (see ``read_for``)."""
        self.read_lock.release()
        if self.sleepers:
            with self.transport._cond:
                self.transport._cond.notify_all()

    def advance(self, deadline: float | None) -> bool:
        """Read what has arrived, up to the end of one frame, and deliver a frame that is
        complete (the caller holds ``read_lock``). True if any bytes came. A failure ends
        the link and is recorded against the peer and the receive being filled."""
        t = self.transport
        try:
            frame, header = self._frame, False
            if frame is None:
                try:
                    n = self.sock.recv_into(self._header[self._got :])
                except BlockingIOError:
                    return False
                if n == 0:
                    self._eof()
                self._got += n
                if self._got < HEADER.size:
                    return True
                self._got, header = 0, True
                frame = self._frame = self._begin()
            # the payload (a small one most often came with its header): what has arrived of it
            view = frame.piece[self._got :]
            try:
                n = self.sock.recv_into(view) if len(view) else 0
            except BlockingIOError:
                return header  # True if the header came in this call
            if n == 0 and len(view):
                self._eof()
            self._got += n
            if self._got == len(frame.piece):
                self._got = 0
                if frame.left:  # a mismatched payload, read and dropped a piece at a time
                    frame.next_piece()
                else:
                    self._frame = None
                    t._complete(self, frame)
            return True
        except Exception as exc:
            self._failed(exc)
        return False

    def _failed(self, exc: Exception) -> None:
        """Reading failed with ``exc``: end the link, with the error its receives get."""
        if isinstance(exc, FerrodistError):
            self._end(exc)
        elif isinstance(exc, OSError):
            self._end(
                PeerLost(
                    f"the connection from rank {self.peer} broke ({exc.strerror or exc}): it died or was killed",
                    peer=self.peer,
                    rank=self.transport.rank,
                )
            )
        else:
            self._end(ProtocolError(f"reading from rank {self.peer} failed: {exc!r}", rank=self.transport.rank))

    def read_direct(self, pending: Pending, deadline: float) -> int:
        """A caller's read of the message ``pending`` is for, straight into its buffer: no
        mailbox, no frame record, no lock but the reader's. The caller holds ``read_lock``,
        the link is between frames (a header may have begun) and no receive or kept message
        of pending's tag is queued, so the link's next frame is pending's message or is not
        for it. Returns ``DIRECT_DONE`` (pending is filled), ``DIRECT_WAIT`` (no whole header
        yet, or the link failed: the general reader goes on from here, pending posted),
        ``DIRECT_OTHER`` (a whole header of another message: post pending, then begin that
        frame) or ``DIRECT_PAYLOAD`` (pending's message has begun: its frame is the
        link's now, pending claimed, and the general reader finishes it)."""
        if compiled.AVAILABLE:
            try:
                return self._read_compiled(pending, deadline)
            except compiled.NotCompiled:  # its code is not ready yet: the same steps in Python
                compiled.missed()
        sock, header, yields = self.sock, self._header, self.transport.yields
        try:
            while self._got < HEADER.size:
                try:
                    n = sock.recv_into(header[self._got :])
                except BlockingIOError:
                    if yields:  # ranks outnumber the cores: the sender may be waiting for this one
                        yields -= 1
                        os.sched_yield()
                    elif not self._wait(self._readable, min(deadline, time.monotonic() + _LOOK)):
                        return DIRECT_WAIT  # the general reader looks at aborts and the deadline
                    continue
                if n == 0:
                    return DIRECT_WAIT  # the peer closed: the general reader says so
                self._got += n
            magic, version, kind, reserved, tag, sequence, fingerprint, length = HEADER.unpack(header)
            buf = pending.buf
            if (
                kind != DATA
                or tag != pending.tag
                or length != buf.nbytes
                or sequence != self.recv_seq
                or (fingerprint and pending.fingerprint and fingerprint != pending.fingerprint)
                or magic != MAGIC
                or version != PROTOCOL_VERSION
                or reserved
            ):
                return DIRECT_OTHER  # a notice, another message, or one that does not fit: decoded as usual
            self._got = 0
            self.recv_seq += 1
            view = memoryview(buf)  # type: ignore[arg-type]
            got = 0
            while got < length:
                try:
                    n = sock.recv_into(view[got:])
                except BlockingIOError:
                    break
                if n == 0:
                    break
                got += n
        except OSError as exc:
            self._failed(exc)
            return DIRECT_WAIT
        if got == length:
            pending.done = True
            return DIRECT_DONE
        frame = Frame(tag, fingerprint, pending, None)
        frame.piece = view
        pending.claimed = True
        self._frame, self._got = frame, got
        return DIRECT_PAYLOAD

    def _read_compiled(self, pending: Pending, deadline: float, result: int | None = None) -> int:
        """``read_direct``'s steps as one compiled call (``compiled.receive_frame``), while the
        socket has bytes or the wait may give the core away; a poll between calls. ``result``:
        that of a call made already (``exchange``)."""
        tag, fingerprint, buf = compiled.signed(pending.tag), compiled.signed(pending.fingerprint), pending.buf
        yields = self.transport.yields
        while True:
            if result is None:
                result = compiled.receive(
                    self.fd, self._head, self._got, _DATA_WORD, tag, self.recv_seq, fingerprint, buf, yields
                )
            status, count = result & 7, result >> 3
            if status != compiled.WAIT:
                break
            self._got, yields, result = count, 0, None
            if not self._wait(self._readable, min(deadline, time.monotonic() + _LOOK)):
                return DIRECT_WAIT  # the general reader looks at aborts and the deadline
        if status == compiled.FAILED:  # errno, or 0: the stream ended (the general reader says so)
            if count:
                self._failed(OSError(count, os.strerror(count)))
            return DIRECT_WAIT
        if status == compiled.OTHER:
            self._got = HEADER.size
            return DIRECT_OTHER
        self._got = 0
        self.recv_seq += 1
        if status == compiled.DONE:
            pending.done = True
            return DIRECT_DONE
        frame = Frame(pending.tag, pending.fingerprint, pending, None)
        frame.piece = memoryview(buf)  # type: ignore[arg-type]
        pending.claimed = True
        self._frame, self._got = frame, count
        return DIRECT_PAYLOAD

    def take(self, pending: Pending, deadline: float) -> None:
        """The receive of a ``sendrecv`` on this claimed link: read its message straight into
        its buffer where nothing can be in the way (``read_direct``), else post it as
        ``irecv`` does (a message that came meanwhile was kept for it) for the general
        reader (``read_for``)."""
        if self.ended or not self.read_lock.acquire(blocking=False):
            self.transport._post(pending)
            return
        try:
            self._settle(pending, self.read_direct(pending, deadline) if self._clear(pending.tag) else DIRECT_WAIT)
        finally:
            self.let_go()

    def exchange(self, payload: Buffer, pending: Pending, deadline: float) -> bool:
        """A small ``sendrecv`` with this peer both ways, on the claimed link: the frame out
        and, where nothing can be in the way (as in ``take``), pending's message read into
        its buffer, in one compiled call (``compiled.exchange_frames``); what that leaves
        undone goes on as ``send`` and ``take`` would. False: nothing was sent (the code is
        not ready yet, or the link is not clear), the caller sends and takes as usual.
        Raises what ``send`` raises."""
        with self.send_lock:
            if self.ended or not self.read_lock.acquire(blocking=False):
                return False
            try:
                if not self._clear(pending.tag):
                    return False
                try:
                    result = compiled.exchange(
                        self.fd, self._words, compiled.signed(pending.tag), self.send_seq,
                        compiled.signed(pending.fingerprint), payload, self._message, self._head, self._got,
                        self.recv_seq, pending.buf, self.transport.yields,
                    )  # fmt: skip
                except compiled.NotCompiled:
                    compiled.missed()
                    return False
                self.send_seq += 1
                status = result & 7
                if status == compiled.DONE:  # the common case
                    self._got = 0
                    self.recv_seq += 1
                    pending.done = True
                    return True
                if status == compiled.WAIT:  # not here yet: take() waits for it without the send lock
                    self._got = result >> 3
                elif status != compiled.UNSENT:
                    self._settle(pending, self._read_compiled(pending, deadline, result))
                    return True
            finally:
                self.let_go()
            if status == compiled.UNSENT:
                sent = int(self._message[compiled.SENT])
                if sent < 0:
                    raise OSError(-sent, os.strerror(-sent))
                self._finish(self._words_bytes, payload, sent, deadline)
        self.take(pending, deadline)
        return True

    def _clear(self, tag: int) -> bool:
        """Nothing can come before the message of ``tag`` on this link: no frame begun, no
        abort of its channel, no receive or kept message of its tag, the peer not lost (the
        caller holds ``read_lock``; the dicts other threads change only under the
        transport's lock, each read as atomic as the GIL makes it)."""
        t = self.transport
        return (
            self._frame is None
            and t._aborts.error(channel_of(tag)) is None
            and t._mailbox.quiet(self.peer, tag)
            and self.peer not in t._lost
        )

    def _settle(self, pending: Pending, outcome: int) -> None:
        """After a direct read (the caller holds ``read_lock``): post pending for the general
        reader unless it is filled or its frame is the link's now; begin the frame of
        another message whose header is in."""
        if outcome in (DIRECT_WAIT, DIRECT_OTHER):
            self.transport._post(pending)
        if outcome == DIRECT_OTHER:  # a whole header is in: begin its frame as advance would
            try:
                self._got = 0
                self._frame = self._begin()
            except Exception as exc:
                self._failed(exc)

    def last_words(self, channel: int) -> FerrodistError | None:
        """After a send to this peer broke: read the frames it sent before it left, if they
        are still unread (an abort notice, a departure with its reason), and return the
        failure they name, as a receive would have reported it; None if they name none."""
        t = self.transport
        if self.read_lock.acquire(timeout=_LAST_WORDS):  # the link's thread may be reading them now
            try:
                give_up = time.monotonic() + _LAST_WORDS
                while not self.ended and time.monotonic() < give_up and self.advance(give_up):
                    pass
            finally:
                self.let_go()
        with t._cond:
            return t._aborts.error(channel) or t._lost.get(self.peer)

    def _begin(self) -> Frame:
        t = self.transport
        header = decode_header(self._header, expected_sequence=self.recv_seq, max_length=t._max_frame, peer=self.peer)
        self.recv_seq += 1
        if header.kind in (GOODBYE, ABORT) and header.length > NOTICE_LIMIT:
            what = "abort notice" if header.kind == ABORT else "goodbye"
            raise ProtocolError(
                f"rank {t.rank}: rank {self.peer} announced a {what} of {header.length} bytes, longer than any "
                f"notice ({NOTICE_LIMIT} bytes; nothing was reserved for it): the stream from rank {self.peer} is "
                f"corrupt, or what connected as rank {self.peer} is not ferrodist of this version",
                rank=t.rank,
            )
        if header.kind == GOODBYE and header.length:  # it leaves because of a failure: read why
            frame = Frame(header.tag, header.fingerprint, None, None, GOODBYE)
            frame.payload = bytearray(header.length)
            frame.piece = memoryview(frame.payload)
            return frame
        if header.kind == GOODBYE:
            raise PeerLost(
                f"rank {self.peer} closed its transport (it finished, or called destroy_process_group)",
                peer=self.peer,
                rank=t.rank,
                finished=True,
            )
        if header.kind == ABORT:  # a notice: read whole, handled by _complete
            frame = Frame(header.tag, header.fingerprint, None, None, ABORT)
            frame.payload = bytearray(header.length)
            frame.piece = memoryview(frame.payload)
            return frame
        if header.kind != DATA:
            raise ProtocolError(f"rank {self.peer} sent an unexpected HELLO after the handshake")
        return t._begin(self, header.tag, header.fingerprint, header.length)

    def _end(self, error: FerrodistError) -> None:
        self.ended = True
        frame, self._frame = self._frame, None
        self.transport._lose(self.peer, error, frame)

    def _eof(self) -> None:
        if self.transport._closing:
            raise PeerLost("this transport is closing", peer=self.peer)
        raise PeerLost(
            f"rank {self.peer} went away without closing its transport (it exited, crashed or was killed)",
            peer=self.peer,
            rank=self.transport.rank,
        )

    def _wait(self, poller: select.poll, deadline: float) -> bool:
        """Block until the socket is ready; False once ``deadline`` has passed."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if poller.poll(min(left, 1.0) * 1000 + 1):
                return True

    # -- sending (any thread, one frame at a time) ----------------------------------------------
    def send(self, kind: int, tag: int, fingerprint: int, payload: Buffer | None, timeout: float) -> None:
        """Send one frame. Raises ``TimeoutError`` when the peer does not take the bytes in time."""
        nbytes = 0 if payload is None else payload.nbytes
        deadline = time.monotonic() + timeout
        with self.send_lock:
            if payload is not None and 0 < nbytes <= _SMALL and compiled.AVAILABLE:
                try:  # header and payload in one system call from compiled code
                    sent = compiled.send(
                        self.fd, self._words, _WORDS[kind], compiled.signed(tag), self.send_seq,
                        compiled.signed(fingerprint), payload, self._message,
                    )  # fmt: skip
                except compiled.NotCompiled:  # its code is not ready yet: the same steps in Python
                    compiled.missed()
                else:
                    self.send_seq += 1
                    if sent < 0:
                        raise OSError(-sent, os.strerror(-sent))
                    self._finish(self._words_bytes, payload, sent, deadline)
                    return
            header = encode_header(kind, tag, self.send_seq, fingerprint, nbytes)
            self.send_seq += 1
            if payload is None or nbytes == 0:
                self._write(memoryview(header), deadline)
            elif nbytes <= _SMALL:
                try:  # header and payload in one system call, no joined copy
                    sent = self.sock.sendmsg((header, payload))  # type: ignore[arg-type]
                except BlockingIOError:
                    sent = 0
                self._finish(memoryview(header), payload, sent, deadline)
            else:
                self._write(memoryview(header), deadline)
                self._write(memoryview(payload).cast("B"), deadline)  # type: ignore[arg-type]

    def _finish(self, header: memoryview, payload: Buffer, sent: int, deadline: float) -> None:
        """Write what is left of a frame of which ``sent`` bytes are out."""
        if sent < len(header):
            self._write(header[sent:], deadline)
            sent = len(header)
        if sent - len(header) < payload.nbytes:
            self._write(memoryview(payload).cast("B")[sent - len(header) :], deadline)  # type: ignore[arg-type]

    def _write(self, view: memoryview, deadline: float) -> None:
        sent, count = 0, len(view)
        while sent < count:
            try:
                sent += self.sock.send(view[sent:])
            except BlockingIOError:
                if not self._room(deadline):
                    raise TimeoutError from None

    def _room(self, deadline: float) -> bool:
        """A send on this link waits for room: meanwhile read what has arrived on the links
        callers hold (their threads are not reading them), so that two ranks sending to each
        other cannot block each other. False once ``deadline`` has passed."""
        held = [link for link in self.transport._links.values() if link.paused and not link.ended]
        if not held:
            return self._wait(self._writable, deadline)
        masks = {self.fd: select.POLLOUT}
        for link in held:
            masks[link.fd] = masks.get(link.fd, 0) | select.POLLIN
        poller = select.poll()
        for fd, mask in masks.items():
            poller.register(fd, mask)
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        ready = {fd for fd, events in poller.poll(min(left, 1.0) * 1000 + 1) if events & ~select.POLLOUT}
        for link in held:
            if link.fd in ready and link.read_lock.acquire(blocking=False):
                try:
                    while not link.ended and link.advance(deadline):
                        pass
                finally:
                    link.let_go()
        return True
