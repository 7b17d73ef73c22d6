"""Replacements of lost ranks: a process started in the place of one (``ferrodist run -n
MIN:MAX`` starts them) joins a running group at its next commit point.

The launcher gives every rank a join directory (``FERRODIST_JOIN_DIR``) and a replacement
``FERRODIST_JOIN=1`` with the lost rank's ``RANK``. The replacement listens, and writes
where in ``joiner-RANK.json`` there (``join``); at a commit point the group's members read
the directory (``waiting``: the lowest member reads it and tells the others), each takes
the replacements in over the transport (``admitted``: ``Transport.admit``), and the lowest
writes the new group's members and name in ``group-RANK.json``, which the replacement waits
for, with the addresses of the replacements taken in with it (they connect to each other).
Every file appears whole (written aside, then renamed) or not at all.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ferrodist.core import InvalidArgument
from ferrodist.transport import TcpTransport, Transport, local_address

#: The launcher's variables: the job's join directory, and "1" in a replacement.
DIRECTORY, REPLACEMENT = "FERRODIST_JOIN_DIR", "FERRODIST_JOIN"


def directory() -> Path | None:
    """The job's join directory, or None where the launcher keeps none."""
    named = os.environ.get(DIRECTORY, "")
    return Path(named) if named else None


def is_replacement() -> bool:
    """True in a process started in the place of a lost rank (it joins a running group)."""
    return os.environ.get(REPLACEMENT, "") == "1" and directory() is not None


def _write(path: Path, record: object) -> None:
    aside = path.with_name(f".{path.name}.{os.getpid()}")
    aside.write_text(json.dumps(record))
    os.replace(aside, path)


def waiting(place: Path, members: Sequence[int]) -> dict[int, str]:
    """The replacements waiting in ``place`` for a rank that is not a member: rank -> address."""
    found = {}
    for path in sorted(place.glob("joiner-*.json")):
        try:
            record = json.loads(path.read_text())
            rank, address = int(record["rank"]), str(record["address"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if rank not in members:
            found[rank] = address
    return found


def admitted(
    transport: Transport, ranks: Sequence[int], name: str, joiners: Mapping[int, str], timeout: float
) -> tuple[tuple[int, ...], str]:
    """Take each of ``joiners`` (rank -> address, the same on every member) in over
    ``transport``; the new group's members and name."""
    if not joiners or any(rank in ranks for rank in joiners):
        raise InvalidArgument(
            f"rank {transport.rank}: grow: joiners {dict(joiners)} must be lost ranks, not members of group {name}"
        )
    deadline = time.monotonic() + timeout
    for rank, address in sorted(joiners.items()):
        transport.admit(rank, address, timeout=max(0.001, deadline - time.monotonic()))
    members = tuple(sorted({*ranks, *joiners}))
    return members, f"{name}+{'.'.join(map(str, sorted(joiners)))}"


def welcome(place: Path, joiners: Mapping[int, str], members: Sequence[int], name: str) -> None:
    """Tell each replacement in ``joiners`` (rank -> address) the group that took it in, and
    where the others taken in with it listen (the lowest member does)."""
    together = {str(rank): address for rank, address in joiners.items()}
    for rank in sorted(joiners):
        _write(place / f"group-{rank}.json", {"members": list(members), "name": name, "joiners": together})
        (place / f"joiner-{rank}.json").unlink(missing_ok=True)


def forget(place: Path, joiners: Sequence[int]) -> None:
    """Drop the word of replacements that could not be taken in (the lowest member does)."""
    for rank in joiners:
        (place / f"joiner-{rank}.json").unlink(missing_ok=True)


def announce(place: Path, rank: int, address: str) -> None:
    """A replacement's word: it listens at ``address`` for the members of the group."""
    (place / f"group-{rank}.json").unlink(missing_ok=True)
    _write(place / f"joiner-{rank}.json", {"rank": rank, "address": address, "pid": os.getpid()})


def taken_in(place: Path, rank: int) -> tuple[list[int], str, dict[int, str]] | None:
    """The members and name of the group that took replacement ``rank`` in, and the
    replacements taken in with it (rank -> address), once written."""
    try:
        record = json.loads((place / f"group-{rank}.json").read_text())
    except (OSError, ValueError):
        return None
    together = {int(r): str(address) for r, address in record.get("joiners", {}).items()}
    return [int(r) for r in record["members"]], str(record["name"]), together


def join(timeout: float, start_timeout: float) -> tuple[TcpTransport, tuple[int, ...], str]:
    """This replacement process joins the running job: its transport, and the members and
    name of the group that took it in (see the module's docstring)."""
    place, rank, size = directory(), int(os.environ.get("RANK", "-1")), int(os.environ.get("WORLD_SIZE", "0"))
    if place is None or not 0 <= rank < size:
        raise InvalidArgument(
            f"init_process_group: a replacement (FERRODIST_JOIN=1) needs {DIRECTORY}, RANK and WORLD_SIZE from its "
            f"launcher; got {place}, RANK={rank}, WORLD_SIZE={size}"
        )
    names: list[str] = []
    together: dict[int, str] = {}

    def members() -> list[int] | None:
        found = taken_in(place, rank)
        if found is None:
            return None
        names[:] = [found[1]]
        together.update(found[2])
        return found[0]

    transport, group = TcpTransport.join(
        rank=rank,
        world_size=size,
        announce=lambda address: announce(place, rank, address),
        members=members,
        timeout=timeout,
        host=local_address(os.environ.get("MASTER_ADDR", "127.0.0.1")),
        start_timeout=start_timeout,
        others=lambda: together,
    )
    return transport, group, names[0]
