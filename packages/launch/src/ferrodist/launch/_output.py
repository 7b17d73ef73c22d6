"""The ranks' output on the launcher's console, each piece labelled with its rank, and
optionally copied verbatim to one log file per rank.

Output is split into *segments*: text up to and including a ``\\n``, a ``\\r`` or a
``\\r\\n``. Every segment a rank starts is prefixed with ``[rank k] ``, so a progress bar
that redraws itself with ``\\r`` stays labelled at every redraw. Bytes are passed on as soon
as they arrive, not held until a newline: an unfinished segment (a bar between two
redraws, a prompt) shows once the rank has written nothing more for ``HOLD`` seconds (so
that ``print``, which writes its text and its newline separately, still makes one piece),
and the rank's next bytes continue it. When another rank writes while one rank's segment
is unfinished, the console first ends that line with a ``\\n`` (on the console only; the log
file gets exactly what the rank wrote), and the interrupted rank's next bytes start a new
labelled segment; a lone newline that would only end the line already ended is dropped.

That is for a terminal. Into a file or a pipe (``redraws=False``: a log, a CI job) a ``\r``
does not go back to the start of a line, and a progress bar's redraws would run together
with the lines printed between them. There each rank's output is shown a line at a time,
as a terminal would leave it: a ``\r`` starts the line again, so a bar's redraws and the
blanks that clear it are dropped, and a line is written whole, with its label, when it ends
(or when the rank ends).
"""

from __future__ import annotations

import os
import re
import select
import threading
from typing import IO, BinaryIO

__all__ = ["HOLD", "Console", "pump"]

#: Seconds an unfinished segment waits for the rest of its bytes before it is shown.
HOLD = 0.05
_SEGMENT = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+")


class Console:
    """The launcher's output stream, shared by the threads that copy the ranks' output.

    Example:
        >>> import io
        >>> sink = io.BytesIO()
        >>> console = Console(sink)
        >>> console.write(0, b"\\r 10%")
        >>> console.write(1, b"ready\\n")
        >>> console.write(0, b"\\r 20%\\n")
        >>> sink.getvalue()
        b'\\r[rank 0]  10%\\n[rank 1] ready\\n\\r[rank 0]  20%\\n'
    """

    def __init__(self, sink: BinaryIO, *, redraws: bool = True) -> None:
        self._sink = sink
        self._redraws = redraws
        self._lines: dict[int, bytes] = {}  # without redraws: rank -> its line so far
        self._drawn: dict[int, bytes] = {}  # without redraws: rank -> the last line it redrew
        self._lock = threading.Lock()
        self._open: int | None = None  # the rank whose segment the console line shows unfinished
        self._fresh: dict[int, bool] = {}  # rank -> its next byte starts a segment
        self._after_cr: dict[int, bool] = {}  # rank -> the last byte it wrote was a lone \r
        self._cut: dict[int, bool] = {}  # rank -> the console ended its unfinished line for it

    @classmethod
    def of(cls, sink: BinaryIO) -> Console:
        """A console for ``sink``: live redraws on a terminal, whole lines into anything else."""
        try:
            terminal = sink.isatty()
        except (AttributeError, ValueError, OSError):
            terminal = False
        return cls(sink, redraws=terminal)

    def write(self, rank: int, data: bytes) -> None:
        """Show ``data``, the next bytes rank ``rank`` wrote."""
        with self._lock:
            for segment in _SEGMENT.findall(data):
                if self._redraws:
                    self._segment(rank, segment)
                else:
                    self._line_of(rank, segment)
            self._sink.flush()

    def end(self, rank: int) -> None:
        """Rank ``rank`` wrote its last byte: end its line if it left one unfinished."""
        with self._lock:
            if self._open == rank:
                self._close_line()
                self._sink.flush()
            if not self._redraws and (self._lines.get(rank, b"").strip() or self._drawn.get(rank)):
                self._line_of(rank, b"\n")
                self._sink.flush()

    def _line_of(self, rank: int, segment: bytes) -> None:
        """Without redraws: a line is written when it ends; a ``\r`` starts it again."""
        text = self._lines.pop(rank, b"") + segment.rstrip(b"\r\n")
        if segment.endswith(b"\n"):
            if not text.strip():
                text = self._drawn.get(rank, text)  # a bar that ended its line as it stood
            self._drawn.pop(rank, None)
            self._sink.write(f"[rank {rank}] ".encode() + text + b"\n")
        elif segment.endswith(b"\r"):
            if text.strip():
                self._drawn[rank] = text
        else:
            self._lines[rank] = text  # unfinished: the rest comes later

    def line(self, text: str) -> None:
        """A line of the launcher's own (the summary), on a line of its own."""
        with self._lock:
            if self._open is not None:
                self._close_line()
            self._sink.write(text.encode() + b"\n")
            self._sink.flush()

    def _segment(self, rank: int, segment: bytes) -> None:
        if self._open is not None and self._open != rank:
            self._close_line()
        cut, self._cut[rank] = self._cut.get(rank, False), False
        if segment == b"\n" and (cut or (self._open == rank and self._after_cr.get(rank, False))):
            if not cut:
                self._sink.write(b"\n")  # a \r\n that arrived in two reads
        else:
            if self._fresh.get(rank, True) and segment != b"\r":
                self._sink.write(f"[rank {rank}] ".encode())
            self._sink.write(segment)
        ends_line = segment.endswith(b"\n")
        self._after_cr[rank] = segment.endswith(b"\r")
        self._fresh[rank] = ends_line or self._after_cr[rank]
        self._open = None if ends_line else rank

    def _close_line(self) -> None:
        assert self._open is not None
        self._sink.write(b"\n")
        self._fresh[self._open] = True
        self._after_cr[self._open] = False
        self._cut[self._open] = True
        self._open = None


def pump(stream: IO[bytes], rank: int, console: Console, log: BinaryIO | None = None) -> None:
    """Copy what a rank writes to ``stream`` to the console (and to ``log``, unchanged) until
    the rank closes it; closes ``stream`` and ``log``."""
    fd = stream.fileno()
    try:
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except InterruptedError:
                continue
            if not data:
                break
            while len(data) < 1 << 16 and not data.endswith((b"\n", b"\r")) and select.select([fd], [], [], HOLD)[0]:
                more = os.read(fd, 1 << 16)  # the rest of an unfinished segment, if it comes at once
                if not more:
                    break
                data += more
            if log is not None:
                log.write(data)
                log.flush()
            console.write(rank, data)
    finally:
        console.end(rank)
        stream.close()
        if log is not None:
            log.close()
