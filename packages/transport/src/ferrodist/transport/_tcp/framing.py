"""One TCP connection's frames, both ways (``Framing``): what a ``Link`` reads and writes.

Reading is resumable: whoever holds ``read_lock`` reads what has arrived, a piece at a
time (``read``), and stops wherever the bytes stop, mid-frame included; the next reader
goes on from there. A whole header is decoded and checked (``begin``) before anything is
reserved for its payload; an abort notice or a goodbye is read whole, but announcing more
than ``NOTICE_LIMIT`` bytes is a ``ProtocolError``. Where a DATA frame's payload goes is
the link's matter (``begin_data``), and so is what a whole frame means (``deliver``).

A frame of up to 64 KiB is sent, and an awaited message read straight into its buffer
(``read_direct``), by compiled code (``compiled``): the system calls without the
interpreter between them. Before that code is ready (or off 64-bit Linux) the same steps
run in Python, and the peer sees the same bytes either way.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Callable

import numpy as np

from ferrodist.core import PeerLost, ProtocolError
from ferrodist.core.kernels import NotCompiled, Twin
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

__all__ = ["DIRECT_DONE", "DIRECT_OTHER", "DIRECT_PAYLOAD", "DIRECT_WAIT", "LOOK", "NOTICE_LIMIT", "Framing"]

_SMALL = 64 << 10  # payloads up to this size go out in one write with their header
#: The most bytes an abort notice or a goodbye's reason may take (a JSON error: a few KiB).
NOTICE_LIMIT = 1 << 20
#: Seconds between a reading caller's looks at the aborted channels (notices may come on other links).
LOOK = 0.05
#: What ``Framing.read_direct`` did.
DIRECT_DONE, DIRECT_WAIT, DIRECT_OTHER, DIRECT_PAYLOAD = range(4)
_DATA_WORD = compiled.first_word(DATA)
_WORDS = {kind: compiled.first_word(kind) for kind in (DATA, HELLO, GOODBYE, ABORT)}


class Framing:
    """The frames of the connection to ``peer``: a send lock and sequence, and a resumable
    reader (``read_lock``, the header and the frame being read).

    ``begin_data(tag, fingerprint, length)``: the frame a DATA header's payload goes into;
    ``deliver(frame)``: a whole frame has been read (both under ``read_lock``);
    ``room(deadline)``: what a send does while the socket has no room (False: the deadline
    passed). The socket is non-blocking; every wait is a ``poll`` with a deadline.
    """

    def __init__(
        self,
        sock: socket.socket,
        rank: int,
        peer: int,
        max_frame: int,
        begin_data: Callable[[int, int, int], Frame],
        deliver: Callable[[Frame], None],
        room: Callable[[float], bool],
        missed: Callable[[NotCompiled], None],
    ) -> None:
        self.sock = sock
        sock.setblocking(False)
        self.fd = sock.fileno()
        self.rank = rank
        self.peer = peer
        self.max_frame = max_frame  # the longest payload a header may announce
        self._begin_data = begin_data
        self._deliver = deliver
        self._room = room
        self.send_lock = threading.Lock()
        self.send_seq = 1  # HELLO was frame 0 in both directions
        self.recv_seq = 1
        self.read_lock = threading.Lock()
        # the frame being read (guarded by read_lock)
        self.head = np.zeros(HEADER.size, np.uint8)
        self._header = memoryview(self.head)  # type: ignore[arg-type]
        self.got = 0  # bytes of the header, then of the current piece of payload
        self.frame: Frame | None = None
        self.words = np.zeros(compiled.HEADER_WORDS, np.int64)  # the header being sent (send_lock)
        self._words_bytes = memoryview(self.words).cast("B")  # type: ignore[arg-type]
        self.message = np.zeros(compiled.MSG_WORDS, np.uint64)
        self.readable = select.poll()
        self.readable.register(self.fd, select.POLLIN)
        self.writable = select.poll()
        self.writable.register(self.fd, select.POLLOUT)
        # The compiled frame calls and the same steps in Python (64-bit Linux has the former;
        # ``missed``: what a call that found no compiled code queues).
        self.read_direct: Callable[[Pending, float, int], int] = self.read_python
        self._send_small: Callable[[int, int, int, Buffer, float], None] = self._send_small_python
        if compiled.AVAILABLE:
            self.read_direct = Twin(self.read_compiled, self.read_python, queue=missed).call
            self._send_small = Twin(self._send_small_compiled, self._send_small_python, queue=missed).call

    # -- reading (the caller holds read_lock) ---------------------------------------------------
    def read(self) -> bool:
        """Read what has arrived, up to the end of one frame, and deliver a frame that is
        complete. True if any bytes came. Raises ``EOFError`` where the stream ended, and
        what decoding a header raises."""
        frame, header = self.frame, False
        if frame is None:
            try:
                n = self.sock.recv_into(self._header[self.got :])
            except BlockingIOError:
                return False
            if n == 0:
                raise EOFError
            self.got += n
            if self.got < HEADER.size:
                return True
            self.got, header = 0, True
            frame = self.frame = self.begin()
        # the payload (a small one most often came with its header): what has arrived of it
        view = frame.piece[self.got :]
        try:
            n = self.sock.recv_into(view) if len(view) else 0
        except BlockingIOError:
            return header  # True if the header came in this call
        if n == 0 and len(view):
            raise EOFError
        self.got += n
        if self.got == len(frame.piece):
            self.got = 0
            if frame.left:  # a mismatched payload, read and dropped a piece at a time
                frame.next_piece()
            else:
                self.frame = None
                self._deliver(frame)
        return True

    def begin(self) -> Frame:
        """A whole header is in: decode and check it, and say where its payload goes."""
        header = decode_header(self._header, expected_sequence=self.recv_seq, max_length=self.max_frame, peer=self.peer)
        self.recv_seq += 1
        if header.kind in (GOODBYE, ABORT) and header.length > NOTICE_LIMIT:
            what = "abort notice" if header.kind == ABORT else "goodbye"
            raise ProtocolError(
                f"rank {self.rank}: rank {self.peer} announced a {what} of {header.length} bytes, longer than any "
                f"notice ({NOTICE_LIMIT} bytes; nothing was reserved for it): the stream from rank {self.peer} is "
                f"corrupt, or what connected as rank {self.peer} is not ferrodist of this version",
                rank=self.rank,
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
                rank=self.rank,
                finished=True,
            )
        if header.kind == ABORT:  # a notice: read whole, then delivered
            frame = Frame(header.tag, header.fingerprint, None, None, ABORT)
            frame.payload = bytearray(header.length)
            frame.piece = memoryview(frame.payload)
            return frame
        if header.kind != DATA:
            raise ProtocolError(f"rank {self.peer} sent an unexpected HELLO after the handshake")
        return self._begin_data(header.tag, header.fingerprint, header.length)

    def begin_next(self) -> None:
        """After a direct read found another frame's whole header: begin that frame, as
        ``read`` would have."""
        self.got = 0
        self.frame = self.begin()

    def read_python(self, pending: Pending, deadline: float, yields: int) -> int:
        """A caller's read of the message ``pending`` is for, straight into its buffer: no
        mailbox, no frame record, no lock but the reader's. The caller holds ``read_lock``,
        the connection is between frames (a header may have begun) and no receive or kept
        message of pending's tag is queued, so the next frame is pending's message or is
        not for it. Gives the core away up to ``yields`` times while nothing has come.
        Returns ``DIRECT_DONE`` (pending is filled), ``DIRECT_WAIT`` (no whole header yet,
        or the stream ended: the general reader goes on from here, pending posted),
        ``DIRECT_OTHER`` (a whole header of another message: post pending, then begin that
        frame) or ``DIRECT_PAYLOAD`` (pending's message has begun: its frame is the one
        being read now, pending claimed, and the general reader finishes it). Raises
        ``OSError`` where the connection failed. ``read_direct`` is this or, where its code is
        loaded, ``read_compiled``: the same steps as one compiled call."""
        sock, header = self.sock, self._header
        while self.got < HEADER.size:
            try:
                n = sock.recv_into(header[self.got :])
            except BlockingIOError:
                if yields:  # ranks outnumber the cores: the sender may be waiting for this one
                    yields -= 1
                    os.sched_yield()
                elif not self.wait(self.readable, min(deadline, time.monotonic() + LOOK)):
                    return DIRECT_WAIT  # the general reader looks at aborts and the deadline
                continue
            if n == 0:
                return DIRECT_WAIT  # the peer closed: the general reader says so
            self.got += n
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
        self.got = 0
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
        if got == length:
            pending.done = True
            return DIRECT_DONE
        frame = Frame(tag, fingerprint, pending, None)
        frame.piece = view
        pending.claimed = True
        self.frame, self.got = frame, got
        return DIRECT_PAYLOAD

    def read_compiled(self, pending: Pending, deadline: float, yields: int, result: int | None = None) -> int:
        """``read_direct``'s steps as one compiled call (``compiled.receive_frame``), while the
        socket has bytes or the wait may give the core away; a poll between calls. ``result``:
        that of a call made already (``exchange``)."""
        tag, fingerprint, buf = compiled.signed(pending.tag), compiled.signed(pending.fingerprint), pending.buf
        while True:
            if result is None:
                result = compiled.receive(
                    self.fd, self.head, self.got, _DATA_WORD, tag, self.recv_seq, fingerprint, buf, yields
                )
            status, count = result & 7, result >> 3
            if status != compiled.WAIT:
                break
            self.got, yields, result = count, 0, None
            if not self.wait(self.readable, min(deadline, time.monotonic() + LOOK)):
                return DIRECT_WAIT  # the general reader looks at aborts and the deadline
        if status == compiled.FAILED:  # errno, or 0: the stream ended (the general reader says so)
            if count:
                raise OSError(count, os.strerror(count))
            return DIRECT_WAIT
        if status == compiled.OTHER:
            self.got = HEADER.size
            return DIRECT_OTHER
        self.got = 0
        self.recv_seq += 1
        if status == compiled.DONE:
            pending.done = True
            return DIRECT_DONE
        frame = Frame(pending.tag, pending.fingerprint, pending, None)
        frame.piece = memoryview(buf)  # type: ignore[arg-type]
        pending.claimed = True
        self.frame, self.got = frame, count
        return DIRECT_PAYLOAD

    def wait(self, poller: select.poll, deadline: float) -> bool:
        """Block until the socket is ready (``readable`` or ``writable``); False once
        ``deadline`` has passed."""
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
            if payload is not None and 0 < nbytes <= _SMALL:  # header and payload in one system call
                self._send_small(kind, tag, fingerprint, payload, deadline)
                return
            header = encode_header(kind, tag, self.send_seq, fingerprint, nbytes)
            self.send_seq += 1
            self._write(memoryview(header), deadline)
            if payload is not None and nbytes:
                self._write(memoryview(payload).cast("B"), deadline)  # type: ignore[arg-type]

    def _send_small_compiled(self, kind: int, tag: int, fingerprint: int, payload: Buffer, deadline: float) -> None:
        """A small frame from compiled code (``compiled.send_frame``); the caller holds ``send_lock``."""
        sent = compiled.send(
            self.fd, self.words, _WORDS[kind], compiled.signed(tag), self.send_seq,
            compiled.signed(fingerprint), payload, self.message,
        )  # fmt: skip
        self.send_seq += 1
        if sent < 0:
            raise OSError(-sent, os.strerror(-sent))
        self._finish(self._words_bytes, payload, sent, deadline)

    def _send_small_python(self, kind: int, tag: int, fingerprint: int, payload: Buffer, deadline: float) -> None:
        """The same frame with ``sendmsg`` from Python: no joined copy of header and payload."""
        header = encode_header(kind, tag, self.send_seq, fingerprint, payload.nbytes)
        self.send_seq += 1
        try:
            sent = self.sock.sendmsg((header, payload))  # type: ignore[arg-type]
        except BlockingIOError:
            sent = 0
        self._finish(memoryview(header), payload, sent, deadline)

    def exchange(self, payload: Buffer, pending: Pending, yields: int) -> int:
        """A DATA frame of ``payload`` out and, once it is all out, pending's message read
        into its buffer if it is the next frame, in one compiled call
        (``compiled.exchange_frames``). The caller holds ``send_lock`` and ``read_lock``,
        and nothing can come before pending's message. Returns that call's result (a whole
        message: pending is done); raises ``NotCompiled``, before anything is sent, where
        the code is not loaded (``Link.sendrecv``'s twin then sends and reads in Python)."""
        result = compiled.exchange(
            self.fd, self.words, compiled.signed(pending.tag), self.send_seq,
            compiled.signed(pending.fingerprint), payload, self.message, self.head, self.got,
            self.recv_seq, pending.buf, yields,
        )  # fmt: skip
        self.send_seq += 1
        status = result & 7
        if status == compiled.DONE:  # the common case
            self.got = 0
            self.recv_seq += 1
            pending.done = True
        elif status == compiled.WAIT:  # not here yet: the header bytes that are
            self.got = result >> 3
        return result

    def finish_exchange(self, payload: Buffer, deadline: float) -> None:
        """Write what an ``exchange`` that returned ``UNSENT`` left of its frame (the caller
        holds ``send_lock``)."""
        sent = int(self.message[compiled.SENT])
        if sent < 0:
            raise OSError(-sent, os.strerror(-sent))
        self._finish(self._words_bytes, payload, sent, deadline)

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
