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


def _pair_without_rank_2(tmp_path, monkeypatch):
    """A job of 3 whose rank 2 is lost; ranks 0 and 1 in a group of their own."""
    monkeypatch.setenv(replacements.DIRECTORY, str(tmp_path))
    world = tcp_world(3, timeout=10, token=b"test-token")
    world[2].close()
    for t in world[:2]:
        for _ in range(500):
            if 2 in t.gone():
                break
            threading.Event().wait(0.01)
    pair = [ProcessGroup(t, [0, 1], subgroup_channel("pair"), timeout=10, name="pair", native=False) for t in world[:2]]
    return world, pair


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

    def member(group):
        def run():
            for _ in range(500):  # until the replacement has said where it listens
                if replacements.waiting(tmp_path, group.ranks):
                    break
                threading.Event().wait(0.01)
            grown = admit_replacements(group)
            x = np.array([float(group.global_rank + 1)])
            grown.all_reduce(x)
            return grown.ranks, x[0]

        return run

    try:
        results = _threads([member(pair[0]), member(pair[1]), replacement])
    finally:
        for t in world:
            t.close()
    assert results == [((0, 1, 2), 103.0)] * 3, results
    assert not list(tmp_path.glob("joiner-*.json"))  # taken in: its word is gone


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
