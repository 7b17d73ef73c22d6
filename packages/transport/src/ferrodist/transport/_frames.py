"""The wire format of ferrodist's socket transports: one fixed header per frame.

    offset  size  field
    0       4     magic        b"FDST"
    4       1     version      PROTOCOL_VERSION
    5       1     kind         DATA, HELLO, GOODBYE or ABORT
    6       2     reserved     zero
    8       8     tag          the message's tag
    16      8     sequence     frames sent on this connection before this one
    24      8     fingerprint  what the sender's call was (0: not checked)
    32      8     length       payload bytes that follow

All fields little-endian. A header is validated before anything is allocated for its
payload: a wrong magic, version or kind, a non-zero reserved field, a sequence number out
of order or a length over the configured limit is a ``ProtocolError``.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from ferrodist.core import ProtocolError

__all__ = [
    "ABORT",
    "DATA",
    "GOODBYE",
    "HEADER",
    "HELLO",
    "MAGIC",
    "PROTOCOL_VERSION",
    "FrameHeader",
    "decode_header",
    "encode_header",
]

MAGIC = b"FDST"
PROTOCOL_VERSION = 1
DATA, HELLO, GOODBYE, ABORT = 1, 2, 3, 4
_KINDS = {DATA: "DATA", HELLO: "HELLO", GOODBYE: "GOODBYE", ABORT: "ABORT"}
HEADER = struct.Struct("<4sBBHQQQQ")


class FrameHeader(NamedTuple):
    kind: int
    tag: int
    sequence: int
    fingerprint: int
    length: int


def encode_header(kind: int, tag: int, sequence: int, fingerprint: int, length: int) -> bytes:
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, kind, 0, tag, sequence, fingerprint, length)


def decode_header(
    raw: bytes | bytearray | memoryview, *, expected_sequence: int, max_length: int, peer: int
) -> FrameHeader:
    """Validate and decode one header received from ``peer``.

    Raises:
        ProtocolError: the bytes are not a ferrodist frame header, or not the next one.
    """
    if len(raw) != HEADER.size:
        raise ProtocolError(f"frame header from rank {peer} is {len(raw)} bytes, expected {HEADER.size}")
    magic, version, kind, reserved, tag, sequence, fingerprint, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(
            f"rank {peer} sent bytes that are not a ferrodist frame (magic {bytes(magic)!r}); "
            "is something else connected to this port?"
        )
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"rank {peer} speaks ferrodist wire protocol {version}, this process {PROTOCOL_VERSION}: "
            "run the same ferrodist version on every rank"
        )
    if kind not in _KINDS or reserved != 0:
        raise ProtocolError(f"rank {peer} sent a frame of unknown kind {kind} (reserved field {reserved})")
    if sequence != expected_sequence:
        raise ProtocolError(
            f"frame {sequence} from rank {peer} arrived where frame {expected_sequence} was due: the stream is corrupt"
        )
    if length > max_length:
        raise ProtocolError(
            f"rank {peer} announced a {length}-byte frame, over this process's limit of {max_length} bytes "
            "(FERRODIST_MAX_FRAME_BYTES)"
        )
    return FrameHeader(kind, tag, sequence, fingerprint, length)
