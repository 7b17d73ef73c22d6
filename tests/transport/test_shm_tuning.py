"""The shared-memory transport's sizing from the machine: how long a wait spins (long while
the machine has a core for every runnable thread, short when threads queue for cores,
longer still where those beyond the cores are niced processes, measured from /proc) and how
large a slot is (half a core's L2 cache)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ferrodist.transport import _cores
from ferrodist.transport._cores import (
    LONG_SPINS,
    NICED_SPINS,
    SHORT_SPINS,
    SpinPolicy,
    niced_running,
    runnable_threads,
)

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")


@linux
def test_runnable_threads_counts_at_least_the_caller():
    count = runnable_threads()
    assert count is not None and count >= 1


@linux
def test_a_busy_process_at_nice_19_is_counted_as_niced():
    spin = "import os, time; os.nice(19); end = time.monotonic() + 20\nwhile time.monotonic() < end: pass"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    try:
        deadline = time.monotonic() + 10
        while niced_running() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert niced_running() >= 1
    finally:
        busy.kill()
        busy.wait()


class Machine:
    """What the policy reads, set by the test: runnable threads and niced running processes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, running: int, niced: int = 0) -> None:
        self.running, self.niced, self.scans = running, niced, 0
        monkeypatch.setattr(_cores, "runnable_threads", lambda: self.running)
        monkeypatch.setattr(_cores, "niced_running", self._scan)
        monkeypatch.setattr(_cores, "RECOUNT", 0.0)  # count again at every wait

    def _scan(self) -> int:
        self.scans += 1
        return self.niced


def test_waits_spin_long_only_while_every_runnable_thread_has_a_core(monkeypatch):
    machine = Machine(monkeypatch, running=2)
    policy = SpinPolicy(world=2, cores=2)
    assert policy.spins() == LONG_SPINS
    machine.running = 3  # a third thread (a DDP backward beside two ranks' waits) wants a core
    assert policy.spins() == LONG_SPINS  # once: maybe a thread that woke for a moment
    assert policy.spins() == SHORT_SPINS  # twice in a row: it stays
    machine.running = 2
    assert policy.spins() == LONG_SPINS
    monkeypatch.setattr(_cores, "runnable_threads", lambda: None)  # unreadable: as before, long
    assert policy.spins() == LONG_SPINS


def test_beside_niced_processes_small_waits_spin_longer_and_bulk_ones_sleep(monkeypatch):
    """Busy processes at nice 19 take the cores only while the ranks let them: a rank that
    sleeps lets them in and loses its core's place, so a call of one chunk spins through
    (``NICED_SPINS``); a transfer of many chunks sleeps at once in its waits, which is when
    they run instead of taking a core from a rank that copies."""
    machine = Machine(monkeypatch, running=3, niced=1)
    policy = SpinPolicy(world=2, cores=2)
    assert [policy.spins() for _ in range(3)] == [NICED_SPINS] * 3
    assert policy.spins(bulk=True) == SHORT_SPINS
    machine.running = 2  # a rank asleep for a moment: the niced process still counts
    assert policy.spins() == NICED_SPINS
    machine.running, machine.niced = 4, 1  # and a thread of nice 0 beyond the cores
    policy = SpinPolicy(world=2, cores=2)
    assert [policy.spins() for _ in range(2)] == [NICED_SPINS, SHORT_SPINS]


def test_niced_processes_are_counted_once_a_second_and_only_on_a_full_machine(monkeypatch):
    machine = Machine(monkeypatch, running=2, niced=1)
    policy = SpinPolicy(world=2, cores=2)
    assert [policy.spins() for _ in range(50)] == [LONG_SPINS] * 50
    assert machine.scans == 0  # every runnable thread had a core: nothing to count
    machine.running = 3
    assert [policy.spins() for _ in range(50)] == [NICED_SPINS] * 50
    assert machine.scans == 1  # at most once per RECOUNT_NICED


def test_more_ranks_than_cores_or_a_fixed_count_need_no_measurement(monkeypatch):
    monkeypatch.setattr(_cores, "runnable_threads", lambda: pytest.fail("measured"))
    monkeypatch.setattr(_cores, "niced_running", lambda: pytest.fail("measured"))
    assert SpinPolicy(world=8, cores=2).spins() == SHORT_SPINS
    assert SpinPolicy(world=2, fixed=123, cores=2).spins() == 123


def test_a_slot_is_half_a_core_l2_cache_within_bounds(tmp_path):
    from ferrodist.transport._shm.arena import DEFAULT_CHUNK, default_chunk

    def cache(level: str, size: str) -> str:
        folder = tmp_path / f"{level}-{size}"
        folder.mkdir()
        (folder / "level").write_text(level + "\n")
        (folder / "size").write_text(size + "\n")
        return str(folder)

    assert default_chunk(cache("2", "1024K")) == 512 << 10
    assert default_chunk(cache("2", "2048K")) == 1 << 20
    assert default_chunk(cache("2", "1280K")) == 640 << 10
    assert default_chunk(cache("2", "256K")) == 256 << 10  # at least 256 KiB
    assert default_chunk(cache("2", "32M")) == 1 << 20  # at most 1 MiB
    assert default_chunk(cache("3", "32M")) == DEFAULT_CHUNK  # not an L2: the fixed default
    assert default_chunk(str(tmp_path / "missing")) == DEFAULT_CHUNK
    assert default_chunk(cache("2", "lots")) == DEFAULT_CHUNK


def test_ranks_that_outnumber_the_cores_give_the_core_away_before_they_sleep(monkeypatch):
    import mmap

    from ferrodist.transport import TcpTransport
    from ferrodist.transport._shm.arena import Arena

    monkeypatch.setattr(_cores.os, "cpu_count", lambda: 2)
    monkeypatch.delenv("FERRODIST_SHM_YIELDS", raising=False)
    monkeypatch.delenv("FERRODIST_SHM_SPINS", raising=False)
    arena = Arena(mmap.mmap(-1, Arena.size(2, 64, 1)), 0, 2, 64, 1)
    assert arena.yields == 0  # two ranks, two cores: spin, then sleep
    arena.share_host(4)  # two nodes of two ranks started on this machine
    assert arena.yields == 100 and arena.spins == SHORT_SPINS
    monkeypatch.setenv("FERRODIST_SHM_YIELDS", "7")
    arena.share_host(4)
    assert arena.yields == 7
    arena.close()

    tcp = TcpTransport(0, 4, timeout=1.0, max_frame_bytes=1 << 20)
    assert tcp.yields == 0
    tcp.share_host(4)
    assert tcp.yields == 100
    tcp.share_host(2)
    assert tcp.yields == 0


def test_a_wait_gives_the_core_away_between_spins_and_ends_when_the_laggard_arrives():
    """``spin_then_yield``, the compiled loop of a crowded machine's shared-memory waits:
    -1 once every rank's word reaches the target, else the first laggard after its give-aways;
    a rank that arrives while the waiter gives the core away ends the wait."""
    import threading
    import time

    import numpy as np

    from ferrodist.transport._shm import spin

    words, stride = np.zeros(16, np.uint64), 8  # two ranks' counters, a line apart
    assert spin.spin_then_yield(words, stride, 0, 0, 2, 0, 4, 3) == -1
    assert spin.spin_then_yield(words, stride, 0, 0, 2, 1, 4, 3) == 0
    words[0] = 1
    assert spin.spin_then_yield(words, stride, 0, 0, 2, 1, 4, 3) == 1

    def arrive() -> None:
        time.sleep(0.05)
        words[stride] = 1

    late = threading.Thread(target=arrive)
    late.start()
    assert spin.spin_then_yield(words, stride, 0, 0, 2, 1, 4, 10**8) == -1
    late.join()
