"""What node 0's launcher refused while the nodes met: counted by host and reason, the first
few named one by one as they come, then a count now and then, so that a flood of
connections (a port scan, a stray client in a loop) cannot fill the job's output."""

from __future__ import annotations

import collections
import time

__all__ = ["NAMED", "Refused"]

#: Refused connections named one by one; after these they are counted.
NAMED = 5
#: Seconds between two lines that count the refused connections after the named ones.
TALLY_EVERY = 10.0


class Refused:
    """The connections node 0 refused, by (host, reason)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._next_tally = 0.0

    def add(self, host: str, why: str) -> str | None:
        """Count one; the line to print for it now, if any."""
        self.counts[(host, why)] += 1
        total = self.counts.total()
        if total < NAMED:
            return f"ferrodist run: node 0 refused a connection from {host}: {why}"
        if total == NAMED:
            self._next_tally = time.monotonic() + TALLY_EVERY
            return (
                f"ferrodist run: node 0 refused a connection from {host}: {why} (further ones are counted, "
                f"and said every {TALLY_EVERY:g} s)"
            )
        if time.monotonic() >= self._next_tally:
            self._next_tally = time.monotonic() + TALLY_EVERY
            return f"ferrodist run: node 0 has refused {self.tally()}"
        return None

    def tally(self) -> str:
        """``N connection(s): n from host (why); ...``, the most frequent first."""
        total = self.counts.total()
        by = "; ".join(f"{count} from {host} ({why})" for (host, why), count in self.counts.most_common())
        return f"{total} connection{'s' if total != 1 else ''}: {by}"

    def unsaid(self) -> str | None:
        """When the nodes have met: the line that counts what was refused after the named ones
        (None when every one was named)."""
        total = self.counts.total()
        return f"ferrodist run: node 0 refused {self.tally()}" if total > NAMED else None
