"""A small frame's system calls from compiled code: ``send_frame`` writes a header and its
payload with one ``sendmsg``, ``receive_frame`` reads the next frame's header, checks it
against the message a caller waits for, and reads the payload into the caller's buffer;
``exchange_frames`` does both, one after the other, for a sendrecv with one peer.

They do what ``Framing.send`` and ``Framing.read_direct`` (``framing``) do for a small
message, without the interpreter between the system calls: a small exchange between two
nodes spent more CPU in Python than in the kernel. Neither waits: the socket is non-blocking, a wait for room or for
bytes goes back to the caller (``receive_frame`` first gives its core away up to ``yields``
times, as ``read_direct`` does where the ranks outnumber the cores). They are called through
core's background fronts, so the first calls of a process, before their code is compiled or
loaded from Numba's cache, take the Python path, and so does a platform where the layout of
``struct msghdr`` below does not hold (64-bit Linux only).

The system calls themselves are ``ferrodist.transport._libc``'s.
"""

from __future__ import annotations

import errno
import struct
import sys
from typing import Any

import numpy as np
from numba import types

from ferrodist.core.kernels import background, jit
from ferrodist.transport._frames import DATA, HEADER, MAGIC, PROTOCOL_VERSION
from ferrodist.transport._libc import address, sys_recv, sys_sendmsg, sys_yield

__all__ = [
    "AVAILABLE",
    "DONE",
    "FAILED",
    "HEADER_WORDS",
    "MSG_WORDS",
    "OTHER",
    "PAYLOAD",
    "SENT",
    "UNSENT",
    "WAIT",
    "exchange",
    "first_word",
    "frame_kernels",
    "receive",
    "send",
    "signed",
]

#: 64-bit Linux: the ``msghdr`` layout and the flag and errno values used here hold.
AVAILABLE = sys.platform == "linux" and sys.maxsize > 2**32 and sys.byteorder == "little"
_MSG_DONTWAIT, _MSG_NOSIGNAL = 0x40, 0x4000
_EAGAIN, _EINTR = errno.EAGAIN, errno.EINTR
_HEADER = HEADER.size  # 40 bytes: five little-endian 64-bit words
HEADER_WORDS = _HEADER // 8
#: ``send_frame``'s scratch: a ``struct msghdr`` (7 words), two ``struct iovec`` (4 words),
#: and where ``exchange_frames`` leaves what its send did (``SENT``).
MSG_WORDS, SENT = 12, 11
#: What ``receive_frame`` or ``exchange_frames`` did (the low 3 bits of the result; the
#: rest is a count).
DONE, WAIT, OTHER, PAYLOAD, FAILED, UNSENT = range(6)


def first_word(kind: int) -> int:
    """The first header word of a frame of ``kind``: magic, version, kind, reserved."""
    return signed(int.from_bytes(struct.pack("<4sBBH", MAGIC, PROTOCOL_VERSION, kind, 0), "little"))


def signed(word: int) -> int:
    """A 64-bit word (a tag, a fingerprint) as the int64 the compiled code takes."""
    return word - (1 << 64) if word >= 1 << 63 else word


_DATA_WORD = first_word(DATA)  # a compile-time constant of exchange_frames


@jit
def send_frame(
    fd: int, header: Any, word: int, tag: int, sequence: int, fingerprint: int, payload: Any, message: Any
) -> int:
    """Write one frame (its header into ``header``, then header and payload with ``sendmsg``)
    until it is out or the socket has no room. Returns the bytes sent (fewer than the frame's
    when the socket had no room: the caller writes the rest), or -errno."""
    length = payload.size
    header[0] = word
    header[1] = tag
    header[2] = sequence
    header[3] = fingerprint
    header[4] = length
    total = _HEADER + length
    sent = 0
    iov = address(message) + 56  # the iovecs follow the msghdr's 7 words
    while sent < total:
        if sent < _HEADER:
            message[7] = address(header) + sent
            message[8] = _HEADER - sent
            message[9] = address(payload)
            message[10] = length
            message[3] = 2 if length else 1
        else:
            message[7] = address(payload) + (sent - _HEADER)
            message[8] = total - sent
            message[3] = 1
        message[0] = 0  # no address
        message[1] = 0
        message[2] = iov
        message[4] = 0  # no control data
        message[5] = 0
        message[6] = 0
        n = sys_sendmsg(fd, address(message), _MSG_DONTWAIT | _MSG_NOSIGNAL)
        if n < 0:
            if n == -_EINTR:
                continue
            return sent if n == -_EAGAIN else n
        sent += n
    return sent


@jit
def receive_frame(
    fd: int, header: Any, got: int, word: int, tag: int, sequence: int, fingerprint: int, buf: Any, yields: int
) -> int:
    """Read the rest of the next frame's header into ``header`` (``got`` bytes of it are in)
    and, if it is the DATA frame of ``tag``, ``sequence`` and ``buf``'s size (and of
    ``fingerprint`` where both sides give one), its payload into ``buf``. Gives the core away
    up to ``yields`` times while nothing has come. Returns ``status + 8 * count``: DONE
    (``buf`` filled), WAIT (``count`` header bytes in, nothing more now), OTHER (a whole
    header of another frame), PAYLOAD (``count`` payload bytes in, the rest still coming) or
    FAILED (``count`` is errno; 0: the stream ended)."""
    base = address(header)
    while got < _HEADER:
        n = sys_recv(fd, base + got, _HEADER - got, _MSG_DONTWAIT)
        if n > 0:
            got += n
        elif n == 0:
            return FAILED  # errno 0: the stream ended
        elif n == -_EINTR:
            continue
        elif n != -_EAGAIN:
            return FAILED + 8 * -n
        elif yields > 0:
            yields -= 1
            sys_yield()
        else:
            return WAIT + 8 * got
    words = header.view(np.int64)
    length = buf.size
    if words[0] != word or words[1] != tag or words[2] != sequence or words[4] != length:
        return OTHER + 8 * _HEADER
    if words[3] != fingerprint and words[3] != 0 and fingerprint != 0:
        return OTHER + 8 * _HEADER
    into = address(buf)
    done = 0
    while done < length:
        n = sys_recv(fd, into + done, length - done, _MSG_DONTWAIT)
        if n > 0:
            done += n
        elif n == -_EINTR:
            continue
        elif n == -_EAGAIN and yields > 0:
            yields -= 1
            sys_yield()
        else:
            break  # nothing more now, the end of the stream or a failure: the general reader says which
    return (DONE if done == length else PAYLOAD) + 8 * done


@jit
def exchange_frames(
    fd: int, words: Any, tag: int, sequence: int, fingerprint: int, payload: Any, message: Any,
    header: Any, got: int, expected: int, buf: Any, yields: int,
) -> int:  # fmt: skip
    """One small exchange with a peer: ``send_frame`` of a DATA frame, then, once all of it
    is out, ``receive_frame`` of the peer's frame ``expected`` (same tag and fingerprint).
    Returns ``receive_frame``'s result, or UNSENT when the frame is not all out (the bytes
    sent, or -errno, are in ``message[SENT]``; nothing was read)."""
    sent = send_frame(fd, words, _DATA_WORD, tag, sequence, fingerprint, payload, message)
    message[SENT] = sent
    if sent != _HEADER + payload.size:
        return UNSENT
    return receive_frame(fd, header, got, _DATA_WORD, tag, expected, fingerprint, buf, yields)


send = background(send_frame)
receive = background(receive_frame)
exchange = background(exchange_frames)
#: Small frames a process moves through Python before it queues these compiles (about
#: 1.7 s of CPU on an empty cache): a job's start moves a handful, a training loop thousands.
WORTH_COMPILING = 64


def frame_kernels() -> list[tuple[Any, tuple[Any, ...]]]:
    """The three functions with the types the links pass (int64 scalars, the link's header
    words and scratch, uint8 buffers; a payload to send may be read-only), the most used
    first; none where the compiled calls are not available."""
    if not AVAILABLE:
        return []
    i, words, scratch = types.int64, types.Array(types.int64, 1, "C"), types.Array(types.uint64, 1, "C")
    raw, frozen = types.Array(types.uint8, 1, "C"), types.Array(types.uint8, 1, "C", readonly=True)
    sends, receives, exchanges = background(send_frame), background(receive_frame), background(exchange_frames)
    return [
        (exchanges, (i, words, i, i, i, raw, scratch, raw, i, i, raw, i)),
        (receives, (i, raw, i, i, i, i, i, raw, i)),
        (sends, (i, words, i, i, i, i, raw, scratch)),
        (sends, (i, words, i, i, i, i, frozen, scratch)),
        (exchanges, (i, words, i, i, i, frozen, scratch, raw, i, i, raw, i)),
    ]
