"""How a rank's waits share this host's cores with the job's other ranks and with whatever
else runs there: how long a shared-memory wait spins before it sleeps (``SpinPolicy``,
measured from the machine's runnable threads), and how often a wait gives its core away
before it sleeps where the job's ranks outnumber the cores (``yields_for``: on a socket and
in shared memory alike).
"""

from __future__ import annotations

import os
import time

__all__ = [
    "CROWDED_YIELDS",
    "LONG_SPINS",
    "NICED_SPINS",
    "SHORT_SPINS",
    "SpinPolicy",
    "niced_running",
    "runnable_threads",
    "yields_for",
]

#: Spins of a wait while every runnable thread of the machine has a core: about 100 us, as
#: a peer that is copying a chunk is not worth a futex sleep and wake-up, which cost as
#: much here.
LONG_SPINS = 40000
#: Spins of a wait while threads queue for cores (ranks share cores, or another thread of
#: this process, a DDP backward for one, is computing): sleep almost at once, so the
#: waiting thread gives its core to a thread that has work.
SHORT_SPINS = 64
#: Spins of a wait while the cores are taken only by processes at nice 10 or more: about
#: 2 ms, as MPI's busy waits do. A rank that sleeps lets such a process onto its core, and
#: the scheduler then often puts both ranks on the other core, where their waits take turns
#: (150 us a 4 KiB all_reduce, against 9 us spinning).
NICED_SPINS = 800000
#: How often the machine's runnable threads are counted again (seconds).
RECOUNT = 0.002
#: How often, while the machine's runnable threads outnumber its cores, the running
#: processes that give their core away (nice ``NICED`` or more) are counted again (seconds).
RECOUNT_NICED = 1.0
NICED = 10
#: How often a wait gives the core away (``sched_yield``) before it sleeps, where the job's
#: ranks on this host outnumber its cores: the rank it waits for most likely waits for that core.
CROWDED_YIELDS = 100


def yields_for(ranks: int) -> int:
    """How often a wait gives the core away before it sleeps, for ``ranks`` ranks of the job
    on this host: ``CROWDED_YIELDS`` where they outnumber the cores, else none."""
    return CROWDED_YIELDS if ranks > (os.cpu_count() or 1) else 0


_LOADAVG: list[int] = []  # an open descriptor of /proc/loadavg (read again with pread)


def runnable_threads() -> int | None:
    """Threads runnable on this machine now, the caller included (Linux: the fourth field
    of ``/proc/loadavg``); None where it cannot be read."""
    try:
        if not _LOADAVG:
            _LOADAVG.append(os.open("/proc/loadavg", os.O_RDONLY))
        fields = os.pread(_LOADAVG[0], 128, 0).split()
        return int(fields[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return None


def niced_running() -> int:
    """Processes of this machine running or runnable at nice ``NICED`` or more (Linux: each
    one's ``/proc/PID/stat``): the scheduler runs a thread of nice 0 before them whenever
    it wants a core, so they do not crowd it. About 1 ms per 60 processes."""
    count = 0
    try:
        names = os.listdir("/proc")
    except OSError:
        return 0
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                data = stat.read()
            fields = data[data.rindex(b")") + 2 :].split()
            if fields[0] == b"R" and int(fields[16]) >= NICED:
                count += 1
        except (OSError, ValueError, IndexError):
            continue
    return count


class SpinPolicy:
    """How many rounds a shared-memory wait spins before it sleeps on a futex.

    Measured, not guessed: every ``RECOUNT`` seconds at most, :func:`runnable_threads` is
    compared with the machine's cores. While every runnable thread has a core, waits spin
    ``LONG_SPINS`` rounds (a sleep and a wake-up cost more than a short wait); when threads
    queue for cores, ``SHORT_SPINS``, so that a waiting rank does not take the core that
    another thread (a DDP backward, a rank sharing the core) needs. Where the threads beyond
    the cores are processes at nice 10 or more (:func:`niced_running`, counted once per
    ``RECOUNT_NICED`` seconds while the threads outnumber the cores), ``NICED_SPINS``: the
    scheduler gives the core to the waiting rank whenever it wants it, and a rank that
    sleeps lets them in and loses its place. ``fixed`` (from ``FERRODIST_SHM_SPINS``) turns the
    measurement off.
    """

    def __init__(self, world: int, fixed: int = 0, cores: int | None = None) -> None:
        self.cores = cores or os.cpu_count() or 1
        self.fixed = fixed or (SHORT_SPINS if world > self.cores else 0)  # ranks alone oversubscribe
        self._spins = self.fixed or LONG_SPINS
        self._next = 0.0
        self._niced = 0
        self._next_niced = 0.0
        self._full = -RECOUNT_NICED - 1.0  # when the runnable threads last outnumbered the cores
        self._over = 0  # counts in a row that found threads (not niced) queued for cores

    def spins(self, bulk: bool = False) -> int:
        """The spin budget for a wait that starts now; ``bulk``: a wait of a transfer of many
        chunks, which spins no longer than ``LONG_SPINS`` beside niced processes: its waits
        last a chunk's copy, and where they sleep the niced processes run in those gaps
        instead of taking a core from a rank that copies (a 64 MiB all_reduce beside one
        such process: 20 ms sleeping at once, 110 ms spinning for ``NICED_SPINS``)."""
        spins = self._decide()
        return SHORT_SPINS if bulk and spins == NICED_SPINS else spins

    def _decide(self) -> int:
        if self.fixed:
            return self.fixed
        now = time.monotonic()
        if now >= self._next:
            self._next = now + RECOUNT
            running = runnable_threads()
            if running is None:
                self._spins = LONG_SPINS
                return self._spins
            if running > self.cores:
                self._full = now
            if now - self._full > RECOUNT_NICED:  # no thread has queued for a core lately
                self._spins = LONG_SPINS
                return self._spins
            if now >= self._next_niced:
                self._niced = niced_running()
                self._next_niced = time.monotonic() + RECOUNT_NICED
            over = running - self._niced > self.cores
            self._over = self._over + 1 if over else 0
            if self._over >= 2:  # two counts in a row: not a thread that woke for a moment
                self._spins = SHORT_SPINS
            else:
                self._spins = NICED_SPINS if self._niced else LONG_SPINS
        return self._spins
