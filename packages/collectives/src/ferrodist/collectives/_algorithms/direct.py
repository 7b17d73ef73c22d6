"""Direct algorithms, where every byte has one source and one destination anyway:
gather and scatter through the root, and pairwise all_to_all."""

from __future__ import annotations

from collections.abc import Sequence

from ferrodist.collectives._call import Array, Call


def gather(call: Call, x: Array, blocks: Sequence[Array] | None, root: int) -> None:
    call.agree()  # ranks naming different roots would each wait for the others
    if call.rank != root:
        call.send(x, root)
        return
    assert blocks is not None
    requests = [call.irecv(blocks[peer], peer) for peer in range(call.size) if peer != root]
    blocks[root][...] = x
    call.wait_all(requests)


def scatter(call: Call, x: Array, blocks: Sequence[Array] | None, root: int) -> None:
    call.agree()  # a root that sends and returns would not notice a peer naming another root
    if call.rank != root:
        call.recv(x, root)
        return
    assert blocks is not None
    requests = [call.isend(blocks[peer], peer) for peer in range(call.size) if peer != root]
    x[...] = blocks[root]
    call.wait_all(requests)


def all_to_all(call: Call, outputs: Sequence[Array], inputs: Sequence[Array]) -> None:
    """Pairwise exchange: at step s send to rank+s and receive from rank-s."""
    rank, size = call.rank, call.size
    outputs[rank][...] = inputs[rank]
    for step in range(1, size):
        to, frm = (rank + step) % size, (rank - step) % size
        call.exchange(inputs[to], to, outputs[frm], frm)
