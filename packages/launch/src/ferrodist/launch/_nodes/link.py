"""What the launchers of a job of several nodes share, hub and member alike: the link to the
other nodes that sends heartbeats (``NodeLink``), the wait that notices this launcher was
stopped (``Watch``, ``froze``), the failure that ends the job on every node
(``NodeFailure``), and their deadlines. ``_nodes`` describes the protocol."""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Sequence

from ferrodist.launch._nodes.channel import Channel
from ferrodist.launch._nodes.joins import Joins
from ferrodist.launch._verdict import RankEnd

__all__ = [
    "DEFAULT_JOIN_TIMEOUT",
    "DEFAULT_SILENCE",
    "FROZE",
    "HEARTBEAT",
    "NodeLink",
    "NodeFailure",
    "Watch",
    "read_signal",
]

#: Seconds node 0's launcher waits for the other nodes' launchers (``--join-timeout``).
DEFAULT_JOIN_TIMEOUT = 300.0
#: Seconds of silence after which a launcher counts another as lost.
DEFAULT_SILENCE = 5.0
HEARTBEAT = 0.5
#: A wait that returns this many seconds later than it asked to means that the launcher itself
#: was stopped (SIGSTOP, a suspended machine) while its deadlines ran.
FROZE = 2.0


class NodeFailure(Exception):
    """The job could not start, or a node was lost: ``summary`` is the line to print."""

    def __init__(self, summary: str, *, node: int | None = None, exit_code: int = 1) -> None:
        super().__init__(summary)
        self.summary = summary
        self.node = node
        self.exit_code = exit_code


class NodeLink:
    """What a launcher's supervisor needs from the other nodes, hub or member."""

    def __init__(self, node: int, silence: float) -> None:
        self.node = node
        self.silence = silence
        self.remote_stop: str | None = None  # why another node's state means: stop our ranks
        self.joins: Joins | None = None  # an elastic job's join directory, kept the same on every node
        self.finished: set[int] = set()  # the nodes whose ranks all finished (an elastic job's failures aside)
        self._beating = threading.Event()
        self._beater: threading.Thread | None = None

    def _channels(self) -> list[Channel]:
        raise NotImplementedError

    def fds(self) -> list[int]:
        return [ch.fileno() for ch in self._channels() if not ch.closed]

    def share_joins(self, place: str) -> None:
        """Keep this node's join directory ``place`` the same as the other nodes' (``joins``)."""
        self.joins = Joins(place)

    def _send_joins(self, to: list[Channel]) -> None:
        """Send the changes this node's ranks made to the join directory to ``to``."""
        if self.joins is not None:
            for change in self.joins.changes():
                for ch in to:
                    if not ch.closed:
                        ch.send("join", **change)

    def start_heartbeats(self) -> None:
        """Heartbeats from a thread of their own (call it after the ranks were forked)."""
        self._beater = threading.Thread(target=self._beat, name="ferrodist-heartbeat", daemon=True)
        self._beater.start()

    def _beat(self) -> None:
        while not self._beating.wait(HEARTBEAT):
            for ch in self._channels():
                if not ch.closed:
                    ch.send("hb")

    def close(self) -> None:
        self._beating.set()
        if self._beater is not None:
            self._beater.join(5)
        for ch in self._channels():
            ch.close()

    @staticmethod
    def _report(
        ends: Sequence[RankEnd], times: dict[int, float], interrupted: int | None, went_on: Sequence[int] = ()
    ) -> dict[str, object]:
        rows = [
            {
                "rank": e.rank,
                "code": e.code,
                "seen": e.seen,
                "at": times.get(e.rank),
                "stopped": e.stopped,
                "error": None if e.error is None else [e.error.name, list(e.error.blames), e.error.message],
            }
            for e in ends
        ]
        return {"ends": rows, "interrupted": interrupted, "went_on": list(went_on)}

    @staticmethod
    def _succeeded(report: dict[str, object]) -> bool:
        """True if a node's ``report`` says its ranks finished: some succeeded, and the others
        are ranks the job went on without."""
        rows, went_on = report.get("ends"), report.get("went_on") or []
        if not isinstance(rows, list) or not isinstance(went_on, list):
            return False
        codes = [(row.get("rank"), row.get("code")) for row in rows if isinstance(row, dict)]
        return any(code == 0 for _, code in codes) and all(code == 0 or rank in went_on for rank, code in codes)


class Watch:
    """``select`` that notices when this launcher was stopped: ``overran`` is True when the
    last wait returned more than ``FROZE`` s after the time it asked for."""

    def __init__(self) -> None:
        self.overran = False

    def select(self, fds: Sequence[int], timeout: float) -> list[int]:
        before = time.monotonic()
        ready: list[int] = select.select(fds, [], [], timeout)[0]
        self.overran = time.monotonic() - before > timeout + FROZE
        return ready

    def woke_late(self, deadline: float) -> float | None:
        """Seconds past ``deadline`` if the last wait overran it (the launcher was stopped
        across its deadline), else None."""
        late = time.monotonic() - deadline
        return late if self.overran and late > 0 else None


def froze(node: int, how: str) -> str:
    """The summary of a job that ended because node ``node``'s launcher was stopped while the
    nodes met: the same opening words on every node (``how``: what this launcher saw)."""
    return f"ferrodist run: node {node}'s launcher froze: {how}; start the job again (or resume it sooner: SIGCONT)"


def read_signal(fd: int) -> int:
    """The signal that the launcher's signal handler wrote to ``fd`` (SIGINT if unreadable)."""
    try:
        data = os.read(fd, 1)
    except BlockingIOError:
        return signal.SIGINT
    return data[0] if data else signal.SIGINT
