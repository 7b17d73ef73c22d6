"""``Shared``: which arrays lie in a group's shared buffers, and where (one rank here: the
exchange of segment addresses with peers is the identity)."""

from __future__ import annotations

import numpy as np
import pytest

from ferrodist.core import BackendUnavailable
from ferrodist.transport._shm import shared as shared_module
from ferrodist.transport._shm.shared import PAGE, Shared


def alone(text: str) -> list[str]:
    return [text]


def test_find_says_which_buffer_and_where_and_nothing_for_other_arrays():
    shared = Shared(0, 1)
    a = shared.allocate(10_000, alone).view(np.float32)
    b = shared.allocate(100, alone)
    assert not a.any() and a.shape == (2500,)
    buffer, offset = shared.find(a[10:20])
    assert (buffer.number, offset) == (0, 40)
    assert shared.find(b)[0].number == 1
    assert shared.find(np.zeros(10, np.float32)) is None
    assert shared.find(a[::2]) is None  # not contiguous: the slots take it
    peers = shared.peers(a[10:20], buffer, 40)
    peers[0][...] = 7
    assert (a[10:20] == 7).all()
    assert shared.place(buffer, 40) != shared.place(shared.find(b)[0], 40)
    shared.close()


def test_a_torch_tensor_on_a_buffer_is_found_by_its_memory():
    torch = pytest.importorskip("torch")
    shared = Shared(0, 1)
    a = shared.allocate(4 * PAGE, alone).view(np.float32)
    assert shared.find(torch.from_numpy(a)[8:].numpy())[1] == 32
    shared.close()


def test_a_rank_that_cannot_map_its_peers_segment_fails_every_rank_saying_which(monkeypatch):
    said: list[str] = []

    def exchange(text: str) -> list[str]:
        said.append(text)
        return [text, "memfd 1 99999 1"] if len(said) == 1 else [text, ""]

    shared = Shared(0, 2)
    with pytest.raises(BackendUnavailable, match="rank 0 could not map rank 1's segment"):
        shared.allocate(100, exchange)
    assert shared.buffers == []
    monkeypatch.setattr(shared_module, "create_segment", lambda size: (_ for _ in ()).throw(OSError("no memory")))
    with pytest.raises(BackendUnavailable, match="rank 0 could not make it"):
        Shared(0, 1).allocate(100, alone)
