"""Growing a group with the replacement of a lost rank (``admit_replacements``,
``ProcessGroup.grow``), over real TCP transports in threads: the replacement, announced in
the join directory, is taken in by every member and computes with them; one that died
before it was taken in makes every member raise, once, and is not tried again."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from _helpers import tcp_world
from ferrodist.collectives import ProcessGroup, admit_replacements
from ferrodist.collectives._call import subgroup_channel
from ferrodist.collectives._failures import replacements
from ferrodist.core import FerrodistError
from ferrodist.transport import TcpTransport

pytestmark = pytest.mark.timeout(60)


def _threads(fns) -> list:
    out: list = [None] * len(fns)

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    return out


def _pair_without_rank_2(tmp_path, monkeypatch, size: int = 3):
    """A job of ``size`` whose ranks 2 and up are lost; ranks 0 and 1 in a group of their own."""
    monkeypatch.setenv(replacements.DIRECTORY, str(tmp_path))
    world = tcp_world(size, timeout=10, token=b"test-token")
    for t in world[2:]:
        t.close()
    for t in world[:2]:
        for _ in range(500):
            if set(range(2, size)) <= set(t.gone()):
                break
            threading.Event().wait(0.01)
    pair = [ProcessGroup(t, [0, 1], subgroup_channel("pair"), timeout=10, name="pair", native=False) for t in world[:2]]
    return world, pair


def _member(place, group, waiting: int):
    """A member of ``group`` that, once ``waiting`` replacements have said where they listen
    in ``place``, takes them in and all_reduces its global rank + 1 with them."""

    def run():
        for _ in range(500):
            if len(replacements.waiting(place, group.ranks)) == waiting:
                break
            threading.Event().wait(0.01)
        grown = admit_replacements(group)
        x = np.array([float(group.global_rank + 1)])
        grown.all_reduce(x)
        return grown.ranks, x[0]

    return run


def test_a_replacement_joins_and_computes_with_the_members(tmp_path, monkeypatch):
    world, pair = _pair_without_rank_2(tmp_path, monkeypatch)

    def replacement():
        def members():
            found = replacements.taken_in(tmp_path, 2)
            return None if found is None else found[0]

        t, group = TcpTransport.join(
            rank=2,
            world_size=3,
            announce=lambda address: replacements.announce(tmp_path, 2, address),
            members=members,
            timeout=10,
            token=b"test-token",
            start_timeout=20,
        )
        name = replacements.taken_in(tmp_path, 2)[1]
        joined = ProcessGroup(t, group, subgroup_channel(name), timeout=10, name=name, native=False)
        x = np.array([100.0])
        joined.all_reduce(x)
        t.close()
        return joined.ranks, x[0]

    try:
        results = _threads([_member(tmp_path, pair[0], 1), _member(tmp_path, pair[1], 1), replacement])
    finally:
        for t in world:
            t.close()
    assert results == [((0, 1, 2), 103.0)] * 3, results
    assert not list(tmp_path.glob("joiner-*.json"))  # taken in: its word is gone


def test_replacements_taken_in_together_connect_to_each_other(tmp_path, monkeypatch):
    """Ranks 2 and 3 of 4 lost; both replacements wait when the pair commits: both are taken
    in at once, each learns where the other listens, and the four compute together."""
    world, pair = _pair_without_rank_2(tmp_path, monkeypatch, size=4)

    def replacement(rank: int):
        def run():
            together: dict[int, str] = {}

            def members():
                found = replacements.taken_in(tmp_path, rank)
                if found is None:
                    return None
                together.update(found[2])
                return found[0]

            t, group = TcpTransport.join(
                rank=rank,
                world_size=4,
                announce=lambda address: replacements.announce(tmp_path, rank, address),
                members=members,
                timeout=10,
                token=b"test-token",
                start_timeout=20,
                others=lambda: together,
            )
            name = replacements.taken_in(tmp_path, rank)[1]
            joined = ProcessGroup(t, group, subgroup_channel(name), timeout=10, name=name, native=False)
            x = np.array([float(rank + 1)])
            joined.all_reduce(x)
            t.close()
            return joined.ranks, x[0], sorted(together)

        return run

    try:
        members = [_member(tmp_path, pair[0], 2), _member(tmp_path, pair[1], 2)]
        results = _threads([*members, replacement(2), replacement(3)])
    finally:
        for t in world:
            t.close()
    assert results[:2] == [((0, 1, 2, 3), 10.0)] * 2, results
    assert results[2:] == [((0, 1, 2, 3), 10.0, [2, 3])] * 2, results


def test_a_replacement_that_died_fails_the_commit_once_and_is_forgotten(tmp_path, monkeypatch):
    world, pair = _pair_without_rank_2(tmp_path, monkeypatch)
    (tmp_path / "joiner-2.json").write_text(json.dumps({"rank": 2, "address": "127.0.0.1:9", "pid": 1}))
    try:
        first = _threads([lambda g=g: admit_replacements(g, timeout=2) for g in pair])
        again = _threads([lambda g=g: admit_replacements(g, timeout=2) for g in pair])
    finally:
        for t in world:
            t.close()
    assert all(isinstance(r, FerrodistError) for r in first), first
    assert again == [None, None]  # nothing waits any more
