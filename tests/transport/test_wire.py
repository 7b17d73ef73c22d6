"""A small frame's system calls from compiled code (``compiled``): the bytes they write are the
frames Python writes, and a read takes only the message it waits for, handing back exactly
where it stopped for anything else."""

from __future__ import annotations

import errno
import socket

import numpy as np
import pytest

from ferrodist.transport._frames import DATA, HEADER, encode_header
from ferrodist.transport._tcp import compiled

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not compiled.AVAILABLE, reason="the compiled socket calls are built for 64-bit Linux only"),
]

TAG, FP = (1 << 63) + 12345, (1 << 64) - 7  # words with the top bit set: they cross as int64
WORD = compiled.first_word(DATA)


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


def _send(sock: socket.socket, payload: np.ndarray, tag: int = TAG, sequence: int = 3, fp: int = FP) -> int:
    words, message = np.zeros(compiled.HEADER_WORDS, np.int64), np.zeros(compiled.MSG_WORDS, np.uint64)
    return compiled.send_frame(
        sock.fileno(), words, WORD, compiled.signed(tag), sequence, compiled.signed(fp), payload, message
    )


def _receive(sock, header, got, buf, tag=TAG, sequence=3, fp=FP, yields=0):
    result = compiled.receive_frame(
        sock.fileno(), header, got, WORD, compiled.signed(tag), sequence, compiled.signed(fp), buf, yields
    )
    return result & 7, result >> 3


@pytest.mark.parametrize("readonly", [False, True])
def test_a_frame_sent_from_compiled_code_is_the_frame_python_encodes(pair, readonly):
    a, b = pair
    payload = np.arange(100, dtype=np.uint8)
    payload.flags.writeable = not readonly
    assert _send(a, payload) == HEADER.size + 100
    assert b.recv(1000) == encode_header(DATA, TAG, 3, FP, 100) + payload.tobytes()


def test_a_read_fills_the_buffer_with_the_message_it_waits_for(pair):
    a, b = pair
    payload = np.arange(1000, dtype=np.uint8)
    header, buf = np.zeros(HEADER.size, np.uint8), np.zeros(1000, np.uint8)
    assert _receive(b, header, 0, buf) == (compiled.WAIT, 0)  # nothing yet
    _send(a, payload)
    assert _receive(b, header, 0, buf) == (compiled.DONE, 1000)
    assert np.array_equal(buf, payload)
    _send(a, payload, sequence=4, fp=0)  # a sender without a fingerprint: not checked
    assert _receive(b, header, 0, buf, sequence=4) == (compiled.DONE, 1000)


@pytest.mark.parametrize(
    "theirs",
    [
        {"tag": TAG + 1},  # another message
        {"sequence": 9},  # a frame out of order
        {"fp": FP - 1},  # another call
        {"size": 999},  # a size that does not fit
    ],
)
def test_a_read_hands_back_any_other_frame_with_its_whole_header_and_leaves_the_payload(pair, theirs):
    a, b = pair
    size = theirs.pop("size", 1000)
    kw = {"tag": TAG, "sequence": 3, "fp": FP, **theirs}
    _send(a, np.ones(size, np.uint8), **kw)
    header, buf = np.zeros(HEADER.size, np.uint8), np.zeros(1000, np.uint8)
    assert _receive(b, header, 0, buf) == (compiled.OTHER, HEADER.size)
    assert header.tobytes() == encode_header(DATA, kw["tag"], kw["sequence"], kw["fp"], size)
    assert not buf.any()
    assert len(b.recv(4096)) == size  # the payload is still the stream's, for the general reader


def test_a_read_goes_on_from_a_partial_header_and_reports_a_partial_payload(pair):
    a, b = pair
    frame = encode_header(DATA, TAG, 3, FP, 1000) + bytes(range(256)) * 3 + bytes(232)
    header, buf = np.zeros(HEADER.size, np.uint8), np.zeros(1000, np.uint8)
    a.send(frame[:10])
    assert _receive(b, header, 0, buf) == (compiled.WAIT, 10)
    a.send(frame[10:500])
    assert _receive(b, header, 10, buf) == (compiled.PAYLOAD, 460)
    assert buf[:460].tobytes() == frame[HEADER.size : 500]


def test_the_end_of_the_stream_and_a_failed_socket_are_reported(pair):
    a, b = pair
    header, buf = np.zeros(HEADER.size, np.uint8), np.zeros(10, np.uint8)
    a.close()
    assert _receive(b, header, 0, buf, yields=3) == (compiled.FAILED, 0)  # 0: the stream ended
    c, d = socket.socketpair()
    c.setblocking(False)
    d.close()
    assert _send(c, np.ones(10, np.uint8)) == -errno.EPIPE
    c.close()


def test_an_exchange_reads_nothing_until_its_frame_is_all_out(pair):
    """A socket with no room: the exchange says how much went out and reads nothing; the
    peer's frame waiting in the other direction is still the stream's."""
    a, b = pair
    filler = np.ones(1 << 16, np.uint8)
    while _send(a, filler) == HEADER.size + filler.size:
        pass  # until a frame goes out only in part
    b.send(encode_header(DATA, TAG, 7, FP, 4) + b"abcd")
    words, message = np.zeros(compiled.HEADER_WORDS, np.int64), np.zeros(compiled.MSG_WORDS, np.uint64)
    header, buf = np.zeros(HEADER.size, np.uint8), np.zeros(4, np.uint8)
    result = compiled.exchange_frames(
        a.fileno(), words, compiled.signed(TAG), 8, compiled.signed(FP), filler, message, header, 0, 7, buf, 0
    )
    assert result & 7 == compiled.UNSENT and 0 <= int(message[compiled.SENT]) < HEADER.size + filler.size
    assert not buf.any() and a.recv(100) == encode_header(DATA, TAG, 7, FP, 4) + b"abcd"


def test_an_exchange_sends_its_frame_and_reads_the_reply():
    a, b = socket.socketpair()
    a.setblocking(False)
    try:
        b.send(encode_header(DATA, TAG, 5, FP, 4) + b"wxyz")  # the peer's half, already there
        words, message = np.zeros(compiled.HEADER_WORDS, np.int64), np.zeros(compiled.MSG_WORDS, np.uint64)
        header, buf = np.zeros(HEADER.size, np.uint8), np.zeros(4, np.uint8)
        mine = np.frombuffer(b"1234", np.uint8)
        result = compiled.exchange_frames(
            a.fileno(), words, compiled.signed(TAG), 9, compiled.signed(FP), mine, message, header, 0, 5, buf, 2
        )
        assert (result & 7, result >> 3) == (compiled.DONE, 4) and buf.tobytes() == b"wxyz"
        assert b.recv(100) == encode_header(DATA, TAG, 9, FP, 4) + b"1234"
    finally:
        a.close()
        b.close()


def test_a_transport_queues_the_compiles_only_once_it_has_moved_enough_small_frames(monkeypatch):
    """A start moves a handful of frames through Python; the compiles (seconds of CPU on an
    empty cache) wait for the ``WORTH_COMPILING``-th, and go once, each a request of its own."""
    from ferrodist.core.kernels import Later as later
    from ferrodist.core.kernels import NotCompiled
    from ferrodist.transport._tcp import context

    queued: list[object] = []
    monkeypatch.setattr("ferrodist.core._compile.twin.prepare", lambda items: queued.append(items))
    frames = context.Context(0, 1 << 20).frames
    assert isinstance(frames, later) and frames.after == compiled.WORTH_COMPILING
    miss = NotCompiled.__new__(NotCompiled)
    for _ in range(compiled.WORTH_COMPILING - 1):
        frames.missed(miss)
    assert queued == []
    frames.missed(miss)
    assert queued == [[item] for item in compiled.frame_kernels()]
    frames.missed(miss)
    assert len(queued) == len(compiled.frame_kernels()), "once"
