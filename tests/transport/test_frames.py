"""The frame header codec, fed valid, mutated and random bytes.

Example counts: 300 random byte strings, 300 mutated valid headers (CI profile).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrodist.core import ProtocolError
from ferrodist.transport._frames import DATA, GOODBYE, HEADER, HELLO, FrameHeader, decode_header, encode_header

LIMIT = 1 << 30
u64 = st.integers(0, (1 << 64) - 1)
headers = st.builds(FrameHeader, st.sampled_from([DATA, HELLO, GOODBYE]), u64, u64, u64, st.integers(0, LIMIT))


@given(h=headers)
def test_round_trip(h):
    raw = encode_header(h.kind, h.tag, h.sequence, h.fingerprint, h.length)
    assert len(raw) == HEADER.size
    assert decode_header(raw, expected_sequence=h.sequence, max_length=LIMIT, peer=1) == h


@settings(max_examples=300)
@given(raw=st.binary(min_size=0, max_size=2 * HEADER.size))
def test_random_bytes_are_a_protocol_error_or_a_valid_header(raw):
    try:
        h = decode_header(raw, expected_sequence=0, max_length=LIMIT, peer=3)
    except ProtocolError:
        return
    assert h.length <= LIMIT and h.sequence == 0  # only a well-formed header gets through


@settings(max_examples=300)
@given(h=headers, position=st.integers(0, HEADER.size - 1), flip=st.integers(1, 255))
def test_mutated_headers_never_escape_as_another_error(h, position, flip):
    raw = bytearray(encode_header(h.kind, h.tag, h.sequence, h.fingerprint, h.length))
    raw[position] ^= flip
    try:
        got = decode_header(bytes(raw), expected_sequence=h.sequence, max_length=LIMIT, peer=0)
    except ProtocolError:
        return
    # What gets through is a well-formed header: a known kind, the due sequence number and
    # a length within the limit (a flip in tag, fingerprint or length can still be one;
    # the check of the payload against the receive, or of the next header, catches it).
    assert got.kind in (DATA, HELLO, GOODBYE)
    assert got.sequence == h.sequence and got.length <= LIMIT
    assert position not in range(0, 4)  # the magic never survives a flip


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: b"HTTP" + r[4:], "not a ferrodist frame"),
        (lambda r: r[:4] + b"\x09" + r[5:], "wire protocol 9"),
        (lambda r: r[:5] + b"\x07" + r[6:], "unknown kind 7"),
        (lambda r: r[:10], "is 10 bytes"),
    ],
)
def test_each_field_is_checked(mutate, message):
    raw = encode_header(DATA, 1, 0, 0, 8)
    with pytest.raises(ProtocolError, match=message):
        decode_header(mutate(raw), expected_sequence=0, max_length=LIMIT, peer=2)


def test_sequence_and_length_limits():
    with pytest.raises(ProtocolError, match="frame 5 from rank 2 arrived where frame 4 was due"):
        decode_header(encode_header(DATA, 1, 5, 0, 8), expected_sequence=4, max_length=LIMIT, peer=2)
    with pytest.raises(ProtocolError, match="over this process's limit"):
        decode_header(encode_header(DATA, 1, 0, 0, 1 << 40), expected_sequence=0, max_length=LIMIT, peer=2)
