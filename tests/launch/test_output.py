"""How the ranks' output reaches the console: every line or ``\\r`` segment labelled, bytes
passed on without waiting for a newline, interleaving ranks never glued onto one line."""

from __future__ import annotations

import io
import os
import threading
import time

import pytest

pytest.importorskip("ferrodist.launch", reason="ferrodist-launch is not installed (pip install packages/launch)")
from ferrodist.launch import _output as output
from ferrodist.launch._output import HOLD, Console, pump


def shown(*writes: tuple[int, bytes]) -> bytes:
    sink = io.BytesIO()
    console = Console(sink)
    for rank, data in writes:
        console.write(rank, data)
    return sink.getvalue()


def test_lines_are_labelled_and_a_line_in_several_writes_is_labelled_once():
    assert shown((0, b"a\nb"), (0, b"c\n"), (1, b"\n")) == b"[rank 0] a\n[rank 0] bc\n[rank 1] \n"


def test_a_progress_bar_is_labelled_at_every_redraw():
    assert shown((0, b"\r 10%"), (0, b"\r 50%"), (0, b"\r100%\n")) == (
        b"\r[rank 0]  10%\r[rank 0]  50%\r[rank 0] 100%\n"
    )


def test_a_rank_writing_into_another_ranks_unfinished_line_gets_a_line_of_its_own():
    # rank 0's bar is cut by rank 1's line; the bar goes on, labelled, below it, and the
    # newline that would only end rank 0's line already ended is not shown again.
    assert shown((0, b"\r 10%"), (1, b"hello\n"), (0, b"\n"), (0, b"\r 20%")) == (
        b"\r[rank 0]  10%\n[rank 1] hello\n\r[rank 0]  20%"
    )


def test_crlf_counts_as_one_line_end_even_when_split_across_reads():
    assert shown((0, b"a\r\nb\r"), (0, b"\n")) == b"[rank 0] a\r\n[rank 0] b\r\n"


def test_the_launchers_own_line_starts_on_a_line_of_its_own():
    sink = io.BytesIO()
    console = Console(sink)
    console.write(2, b"partial")
    console.line("ferrodist run: done")
    assert sink.getvalue() == b"[rank 2] partial\nferrodist run: done\n"


def test_pump_shows_an_unfinished_segment_at_once_and_logs_the_bytes_unchanged(tmp_path):
    read, write = os.pipe()
    sink = io.BytesIO()
    console = Console(sink)
    log = open(tmp_path / "rank-0.log", "wb")
    thread = threading.Thread(target=pump, args=(os.fdopen(read, "rb"), 0, console, log))
    thread.start()
    os.write(write, b"\r 10%")
    give_up = time.monotonic() + 10
    while b"10%" not in sink.getvalue() and time.monotonic() < give_up:
        time.sleep(HOLD / 5)
    assert sink.getvalue() == b"\r[rank 0]  10%", "an unfinished segment must show without a newline"
    os.write(write, b"\r 99%\r\n")
    os.close(write)
    thread.join(10)
    assert sink.getvalue() == b"\r[rank 0]  10%\r[rank 0]  99%\r\n"
    assert (tmp_path / "rank-0.log").read_bytes() == b"\r 10%\r 99%\r\n"


def test_pump_keeps_the_pieces_of_one_print_together(monkeypatch):
    # Unbuffered print("a", "b") writes "a", " b" and "\n" separately; another rank writing
    # in between must not cut the line. (HOLD raised so that a slow machine cannot let it expire.)
    monkeypatch.setattr(output, "HOLD", 2.0)
    read, write = os.pipe()
    sink = io.BytesIO()
    console = Console(sink)
    thread = threading.Thread(target=pump, args=(os.fdopen(read, "rb"), 0, console))
    thread.start()
    os.write(write, b"a")
    time.sleep(0.05)
    console.write(1, b"x\n")
    os.write(write, b" b")
    os.write(write, b"\n")
    os.close(write)
    thread.join(10)
    assert sink.getvalue() == b"[rank 1] x\n[rank 0] a b\n"
