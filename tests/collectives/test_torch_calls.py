"""torch.distributed's calls that ferrodist.collectives adds, on the simulated backend,
against the naive references of ferrodist.testing.

Example counts (CI profile, derandomized; FERRODIST_HYPOTHESIS_PROFILE=dev runs 5x, random):
- object collectives (broadcast_object_list, all_gather_object, gather_object,
  scatter_object_list): 25 examples each of picklable objects (nested lists, tuples,
  dicts, big integers, bytes, text) on 1..6 ranks;
- all_gather_into_tensor: 4 examples per dtype, both output layouts;
- reduce_scatter_tensor: 2 examples per (dtype, op) pair, both input layouts;
- all_to_all_single: 40 examples of split matrices (zeros included) or equal splits,
  rows of 0..3 dimensions, 1..6 ranks;
- batch_isend_irecv: 30 examples of message sets, shuffled per rank;
- recv without src: 10 examples; monitored_barrier: 10 examples (with subgroups);
- rank translation: 15 examples of subgroups; all_gather_single / reduce_scatter_single:
  10 examples; new_subgroups: 10 examples of world and block sizes;
  send_object_list / recv_object_list: 15 examples of object lists between 2 of 2..5 ranks.
async_op is drawn where the call has it. Every rank's result must equal the reference
exactly (reductions: within ferrodist.testing's stated bound) and be the same bits on
every rank. At the end, every call once more between real processes
(tests/integration/scripts/torch_calls.py): tcp with 3 ranks, shm with 2, mpi under mpiexec.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ferrodist.collectives as dist
from _helpers import examples
from ferrodist.core import (
    ALL_DTYPES,
    CollectiveMismatch,
    CollectiveTimeout,
    FerrodistError,
    GroupAborted,
    InvalidArgument,
    InvalidRank,
    ProtocolError,
    ReduceOp,
)
from ferrodist.testing import (
    assert_reduced,
    ref_all_gather_into_tensor,
    ref_all_gather_object,
    ref_all_to_all_single,
    ref_broadcast_object_list,
    ref_gather_object,
    ref_reduce_scatter_tensor,
    ref_scatter_object_list,
    run_world,
)
from ferrodist.testing.strategies import (
    picklable_objects,
    roots,
    shapes,
    split_matrices,
    subgroups,
    tensors,
    world_inputs,
)

SIZES = st.sampled_from([3, 2, 5, 1, 4, 6])
PAIRS = [(dt, op) for dt in ALL_DTYPES for op in sorted(dt.ops, key=lambda o: o.value)]


def finish(work):
    if work is not None:
        work.wait(10)


def assert_same_bits(results):
    first = np.asarray(results[0]).tobytes()
    for r, out in enumerate(results[1:], start=1):
        assert np.asarray(out).tobytes() == first, f"rank {r} disagrees with rank 0 bit for bit"


def failures_of(size, rank_main, timeout=10.0):
    """Run ``rank_main`` on ``size`` ranks; what each raised (or returned) and how long it took."""

    def wrapped():
        start = time.monotonic()
        try:
            return ("ok", rank_main(), time.monotonic() - start)
        except FerrodistError as exc:
            return ("raised", exc, time.monotonic() - start)

    return run_world(size, wrapped, timeout=timeout)


# -- object collectives ------------------------------------------------------------------------
@settings(max_examples=examples(25))
@given(data=st.data(), size=SIZES)
def test_all_gather_object(data, size):
    objects = data.draw(st.lists(picklable_objects(), min_size=size, max_size=size))

    def rank_main():
        out = [None] * size
        dist.all_gather_object(out, objects[dist.get_rank()])
        return out

    assert run_world(size, rank_main) == ref_all_gather_object(objects)


@settings(max_examples=examples(25))
@given(data=st.data(), size=SIZES)
def test_gather_object(data, size):
    objects = data.draw(st.lists(picklable_objects(), min_size=size, max_size=size))
    dst = data.draw(roots(size))

    def rank_main():
        out = ["untouched"] * size if dist.get_rank() == dst else None
        dist.gather_object(objects[dist.get_rank()], out, dst=dst)
        return out

    assert run_world(size, rank_main) == ref_gather_object(objects, dst)


@settings(max_examples=examples(25))
@given(data=st.data(), size=SIZES, count=st.integers(0, 4))
def test_broadcast_object_list(data, size, count):
    src = data.draw(roots(size))
    lists = [data.draw(st.lists(picklable_objects(), min_size=count, max_size=count)) for _ in range(size)]

    def rank_main():
        mine = list(lists[dist.get_rank()])
        dist.broadcast_object_list(mine, src=src)
        return mine

    assert run_world(size, rank_main) == ref_broadcast_object_list(lists, src)


@settings(max_examples=examples(25))
@given(data=st.data(), size=SIZES)
def test_scatter_object_list(data, size):
    src = data.draw(roots(size))
    inputs = data.draw(st.lists(picklable_objects(), min_size=size, max_size=size))

    def rank_main():
        out = ["untouched", "and this stays"]
        # torch's convention: the input list is read on src only (other ranks may pass anything)
        dist.scatter_object_list(out, inputs if dist.get_rank() == src else ["ignored"], src=src)
        assert out[1] == "and this stays"
        return out[:1]

    assert run_world(size, rank_main) == ref_scatter_object_list(inputs, src, size)


def test_object_collectives_on_a_subgroup_take_global_ranks_or_group_ranks():
    def rank_main():
        me = dist.get_rank()
        sub = dist.new_group([1, 3])
        if me not in (1, 3):
            return None
        objs = [f"from {me}"]
        dist.broadcast_object_list(objs, src=3, group=sub)
        gathered = [None, None] if me == 3 else None
        dist.gather_object(me * 2, gathered, group=sub, group_dst=1)  # group rank 1 = global rank 3
        out = [None]
        dist.scatter_object_list(out, ["a", "b"] if me == 1 else None, group=sub, group_src=0)
        every = [None, None]
        dist.all_gather_object(every, {me}, group=sub)
        return objs, gathered, out, every

    results = run_world(4, rank_main)
    assert results[1] == (["from 3"], None, ["a"], [{1}, {3}])
    assert results[3] == (["from 3"], [2, 6], ["b"], [{1}, {3}])


class Unpicklable:
    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")


def _fail_to_load():
    raise ImportError("no module named 'only_on_rank_1'")


class LoadsNowhere:
    """Pickles fine; unpickling it raises, as a class that only the sender can import would."""

    def __reduce__(self):
        return (_fail_to_load, ())


@pytest.mark.parametrize("call", ["all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list"])
def test_an_unpicklable_object_fails_every_rank_naming_its_rank_and_the_group_goes_on(call):
    bad = 1  # the rank whose object cannot be pickled (the source, for the rooted calls)

    def rank_main():
        me = dist.get_rank()
        obj = Unpicklable() if me == bad else me
        if call == "all_gather_object":
            dist.all_gather_object([None] * 3, obj)
        elif call == "gather_object":
            dist.gather_object(obj, [None] * 3 if me == 0 else None, dst=0)
        elif call == "broadcast_object_list":
            dist.broadcast_object_list(["x", obj] if me == bad else [None, None], src=bad)
        else:
            dist.scatter_object_list([None], [0, obj, 2] if me == bad else None, src=bad)

    def then_more():
        try:
            rank_main()
        except InvalidArgument as exc:
            error = exc
        else:
            raise AssertionError("no error")
        out = [None] * 3
        dist.all_gather_object(out, dist.get_rank())  # the group is still usable
        return error, out

    results = run_world(3, then_more)
    for rank, (error, out) in enumerate(results):
        assert out == [0, 1, 2]
        assert str(error).startswith(f"rank {rank}: {call}: ")
        assert "cannot be pickled" in str(error) and "rank 1" in str(error)
    assert "refuses to be pickled" in str(results[bad][0])


def test_bytes_that_do_not_unpickle_raise_on_the_receiver_only_naming_the_sender():
    def rank_main():
        me = dist.get_rank()
        out = ["kept", "kept", "kept"]
        try:
            dist.all_gather_object(out, LoadsNowhere() if me == 1 else me)
        except ProtocolError as exc:
            assert out == ["kept", "kept", "kept"]  # nothing half-written
            error = str(exc)
        total = np.ones(1)
        dist.all_reduce(total)  # every rank's bytes were consumed: the group goes on
        return error, total[0]

    for rank, (error, total) in enumerate(run_world(3, rank_main)):
        assert total == 3.0
        assert error.startswith(f"rank {rank}: all_gather_object: the object from rank 1 cannot be unpickled here")
        assert "only_on_rank_1" in error


def test_object_list_arguments_are_checked_before_anything_moves():
    def rank_main():
        me = dist.get_rank()
        with pytest.raises(InvalidArgument, match=r"rank \d: all_gather_object: object_list has 2 entries"):
            dist.all_gather_object([None, None], me)
        if me != 2:
            with pytest.raises(InvalidArgument, match=r"object_gather_list is only used on the dst rank \(2\)"):
                dist.gather_object(me, [None] * 3, dst=2)
        else:
            with pytest.raises(InvalidArgument, match="object_gather_list must be a list of 3 entries"):
                dist.gather_object(me, None, dst=2)
        with pytest.raises(InvalidArgument, match="scatter_object_output_list must be a list of at least one"):
            dist.scatter_object_list([], None)
        with pytest.raises(InvalidArgument, match=r"pass src .* or group_src .*, not both"):
            dist.broadcast_object_list([1], src=0, group_src=0)
        out = [None] * 3
        dist.all_gather_object(out, me)  # nothing was sent: the ranks still agree on the next call
        return out

    assert run_world(3, rank_main) == [[0, 1, 2]] * 3


def test_lists_of_different_lengths_in_broadcast_object_list_are_a_mismatch_on_every_rank():
    def rank_main():
        objs = [1, 2, 3] if dist.get_rank() == 0 else [None, None]
        dist.broadcast_object_list(objs, src=0)

    results = failures_of(3, rank_main)
    for kind, error, took in results:
        assert kind == "raised" and took < 5
        assert isinstance(error, (CollectiveMismatch, GroupAborted))
    # the ranks with short lists say so; rank 0 hears it from the one that aborted the group
    assert "object_list has 2 entries here but src rank 0 broadcasts 3" in str(results[0][1])
    assert all("broadcast_object_list" in str(e) for _, e, _ in results)


def test_a_rank_in_another_object_collective_is_a_mismatch_named_on_every_rank():
    def rank_main():
        me = dist.get_rank()
        if me == 2:
            dist.gather_object(me, None, dst=0)
        else:
            dist.all_gather_object([None] * 3, me)

    results = failures_of(3, rank_main)
    assert all(kind == "raised" and took < 5 for kind, _, took in results)
    text = " ".join(str(e) for _, e, _ in results)
    assert "gather(uint8 x 5, root=0)" in text and "all_gather(uint8 x 5)" in text
    assert str(results[2][1]).startswith("rank 2: gather_object: ")
    assert str(results[0][1]).startswith("rank 0: all_gather_object: ")


# -- all_gather_into_tensor, reduce_scatter_tensor ---------------------------------------------
@pytest.mark.parametrize("dt", ALL_DTYPES, ids=[d.name for d in ALL_DTYPES])
@settings(max_examples=examples(4))
@given(data=st.data(), size=SIZES, stacked=st.booleans(), async_op=st.booleans())
def test_all_gather_into_tensor(dt, data, size, stacked, async_op):
    shape = data.draw(st.sampled_from([(5,), (2, 3), (), (0, 2)]) | shapes(max_elements=12))
    inputs = data.draw(world_inputs(size, dt, shape))
    expected = ref_all_gather_into_tensor(inputs, stacked=stacked)

    def rank_main():
        out = np.zeros_like(expected[0])
        finish(dist.all_gather_into_tensor(out, inputs[dist.get_rank()], async_op=async_op))
        return out

    results = run_world(size, rank_main)
    for out, want in zip(results, expected, strict=True):
        np.testing.assert_array_equal(out, want)
    assert_same_bits(results)


@pytest.mark.parametrize(("dt", "op"), PAIRS, ids=[f"{d.name}-{o.name}" for d, o in PAIRS])
@settings(max_examples=examples(2))
@given(data=st.data(), size=SIZES, stacked=st.booleans(), async_op=st.booleans())
def test_reduce_scatter_tensor(dt, op, data, size, stacked, async_op):
    block = data.draw(st.sampled_from([(3,), (2, 2), ()]))
    if not block and not stacked:
        block = (1,)
    whole = (size, *block) if stacked else (size * block[0], *block[1:])
    bounds = {"low": -2.0, "high": 2.0} if op is ReduceOp.PRODUCT else {}
    inputs = data.draw(world_inputs(size, dt, whole, **bounds))
    expected = ref_reduce_scatter_tensor(inputs, op, stacked=stacked)

    def rank_main():
        out = np.zeros(block, dt.numpy)
        finish(dist.reduce_scatter_tensor(out, inputs[dist.get_rank()], op, async_op=async_op))
        return out

    results = run_world(size, rank_main)
    for r, out in enumerate(results):
        blocks = [inp[r] if stacked else inp[r * block[0] : (r + 1) * block[0]] for inp in inputs]
        assert_reduced(out, blocks, op, what=f"rank {r}")
        assert out.shape == expected[r].shape


def test_tensor_layouts_other_than_torchs_two_are_refused_before_anything_moves():
    def rank_main():
        x = np.ones((2, 3))
        with pytest.raises(
            InvalidArgument, match=r"output_tensor has shape \(3, 4\).* must be \(6, 3\) or \(3, 2, 3\)"
        ):
            dist.all_gather_into_tensor(np.empty((3, 4)), x)
        with pytest.raises(InvalidArgument, match=r"input has shape \(18,\).* must be \(6, 3\) or \(3, 2, 3\)"):
            dist.reduce_scatter_tensor(np.empty((2, 3)), np.ones(18))
        with pytest.raises(InvalidArgument, match=r"all_gather_into_tensor: output_tensor is int64 but input_tensor"):
            dist.all_gather_into_tensor(np.empty((6, 3), np.int64), x)
        out = np.empty((6, 3))
        dist.all_gather_into_tensor(out, x * dist.get_rank())
        return out[::2, 0]

    for got in run_world(3, rank_main):
        np.testing.assert_array_equal(got, [0, 1, 2])


# -- all_to_all_single -------------------------------------------------------------------------
@settings(max_examples=examples(40))
@given(data=st.data(), size=SIZES, async_op=st.booleans())
def test_all_to_all_single(data, size, async_op):
    dt = data.draw(st.sampled_from(ALL_DTYPES))
    row = data.draw(st.sampled_from([(), (3,), (2, 2), (0,)]))
    even = data.draw(st.booleans())
    if even:
        per = data.draw(st.integers(0, 3))
        matrix = [[per] * size for _ in range(size)]
    else:
        matrix = data.draw(split_matrices(size))
    inputs = [data.draw(tensors(dt, (sum(matrix[i]), *row))) for i in range(size)]
    expected = ref_all_to_all_single(inputs, matrix)

    def rank_main():
        me = dist.get_rank()
        out = np.zeros((sum(matrix[i][me] for i in range(size)), *row), dt.numpy)
        outs = None if even else [matrix[i][me] for i in range(size)]
        ins = None if even else matrix[me]
        finish(dist.all_to_all_single(out, inputs[me], outs, ins, async_op=async_op))
        return out

    for out, want in zip(run_world(size, rank_main), expected, strict=True):
        assert out.shape == want.shape
        np.testing.assert_array_equal(out, want)


def test_splits_that_do_not_add_up_are_refused_before_anything_moves():
    def rank_main():
        x = np.arange(6.0)
        out = np.empty(6)
        with pytest.raises(InvalidArgument, match=r"input_split_sizes \[1, 1\] add up to 2 rows but input has 6"):
            dist.all_to_all_single(out, x, [3, 3], [1, 1])
        with pytest.raises(InvalidArgument, match="output has 5 rows along dim 0, which do not split equally"):
            dist.all_to_all_single(np.empty(5), x)
        with pytest.raises(InvalidArgument, match=r"must be 2 non-negative integers .* not \[4, -1\]"):
            dist.all_to_all_single(out, x, [3, 3], [4, -1])
        dist.all_to_all_single(out, x)
        return out

    results = run_world(2, rank_main)
    np.testing.assert_array_equal(results[0], [0, 1, 2, 0, 1, 2])
    np.testing.assert_array_equal(results[1], [3, 4, 5, 3, 4, 5])


def test_splits_that_contradict_a_peer_fail_on_every_rank_naming_both_sides():
    def rank_main():
        me = dist.get_rank()
        sends = [1, 1, 1]
        expects = [1, 1, 1]
        if me == 1:
            sends = [1, 1, 1]
        if me == 2:
            expects = [1, 2, 1]  # rank 1 sends it 1 row, not 2
        dist.all_to_all_single(np.empty(sum(expects)), np.arange(3.0), expects, sends, timeout=5)

    results = failures_of(3, rank_main)
    for kind, error, took in results:
        assert kind == "raised" and took < 3, (kind, error, took)
    # Whichever of ranks 1 and 2 compares first raises CollectiveMismatch and aborts the
    # group; the others raise with its words (the other side may be still exchanging).
    seen_by_2 = "output_split_sizes[1] here is 2 rows but rank 1 sends 1 (its input_split_sizes[2])"
    seen_by_1 = "input_split_sizes[2] here is 1 rows but rank 2 expects 2 (its output_split_sizes[1])"
    for rank, (_, error, _) in enumerate(results):
        assert str(error).startswith(f"rank {rank}: all_to_all_single #0 on group world")
        assert seen_by_1 in str(error) or seen_by_2 in str(error), str(error)
    assert isinstance(results[1][1], CollectiveMismatch) or isinstance(results[2][1], CollectiveMismatch)


# -- batch_isend_irecv -------------------------------------------------------------------------
@st.composite
def message_sets(draw):
    """(size, messages): each message (src, dst, tag, length); one length per (src, dst, tag)."""
    size = draw(st.sampled_from([2, 3, 4]))
    pairs = [(s, d) for s in range(size) for d in range(size) if s != d]
    count = draw(st.integers(1, 10))
    lengths = {}
    messages = []
    for _ in range(count):
        src, dst = draw(st.sampled_from(pairs))
        tag = draw(st.integers(0, 2))
        length = lengths.setdefault((src, dst, tag), draw(st.integers(0, 5)))
        messages.append((src, dst, tag, length))
    return size, messages


@settings(max_examples=examples(30))
@given(case=message_sets(), seed=st.integers(0, 2**16))
def test_batch_isend_irecv(case, seed):
    size, messages = case
    payload = {k: np.arange(m[3], dtype=np.float64) + 100 * k for k, m in enumerate(messages)}

    def rank_main():
        me = dist.get_rank()
        mine = [k for k, m in enumerate(messages) if me in (m[0], m[1])]
        random.Random(seed * 31 + me).shuffle(mine)  # any order of sends and receives
        ops, received = [], {}
        for k in mine:
            src, dst, tag, length = messages[k]
            if src == me:
                ops.append(dist.P2POp(dist.isend, payload[k], dst, tag=tag))
            else:
                received[k] = np.full(length, -1.0)
                ops.append(dist.P2POp(dist.irecv, received[k], src, tag=tag))
        if ops:
            works = dist.batch_isend_irecv(ops)
            assert len(works) == len(ops)
            for work in works:
                work.wait(10)
        return mine, received

    for me, (order, received) in enumerate(run_world(size, rank_main)):
        expected = _fifo_reference(messages, me, order, seed, size)
        assert set(expected) == set(received)
        for k, got in received.items():
            np.testing.assert_array_equal(got, payload[expected[k]], err_msg=f"rank {me}, message {k}")


def _fifo_reference(messages, me, my_order, seed, size):
    """For each message k this rank receives: the message whose bytes land in its buffer."""
    orders = {}
    for rank in range(size):
        ks = [k for k, m in enumerate(messages) if rank in (m[0], m[1])]
        random.Random(seed * 31 + rank).shuffle(ks)
        orders[rank] = ks
    assert orders[me] == my_order
    landed = {}
    for k in [k for k in orders[me] if messages[k][1] == me]:
        src, _, tag, _ = messages[k]
        recvs = [j for j in orders[me] if messages[j][1] == me and messages[j][0] == src and messages[j][2] == tag]
        sends = [j for j in orders[src] if messages[j][0] == src and messages[j][1] == me and messages[j][2] == tag]
        landed[k] = sends[recvs.index(k)]
    return landed


def test_a_bad_operation_in_a_batch_starts_nothing():
    def rank_main():
        me, other = dist.get_rank(), 1 - dist.get_rank()
        with pytest.raises(InvalidArgument, match=r"P2POp: op must be ferrodist\.collectives\.isend or irecv"):
            dist.P2POp(dist.send, np.ones(1), other)
        with pytest.raises(InvalidArgument, match="entries \\[1\\] are not P2POp"):
            dist.batch_isend_irecv([dist.P2POp(dist.isend, np.ones(1), other), "isend"])
        read_only = np.ones(2)
        read_only.flags.writeable = False
        ops = [dist.P2POp(dist.isend, np.full(2, 5.0 + me), other), dist.P2POp(dist.irecv, read_only, other)]
        with pytest.raises(InvalidArgument, match="read-only"):
            dist.batch_isend_irecv(ops)  # the send before it was not started either
        got = np.empty(2)
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.irecv, got, other), dist.P2POp(dist.isend, np.full(2, 1.0 + me), other)]
        )
        for work in works:
            work.wait(5)
        return got[0]

    assert run_world(2, rank_main) == [2.0, 1.0]  # the refused send's 5.0 / 6.0 never arrived


# -- recv without src ----------------------------------------------------------------------------
@settings(max_examples=examples(10))
@given(size=st.integers(2, 5), data=st.data())
def test_recv_without_src_in_a_group_of_two_returns_the_sender(size, data):
    pair = data.draw(st.lists(st.integers(0, size - 1), min_size=2, max_size=2, unique=True).map(sorted))
    sender = data.draw(st.sampled_from(pair))
    tag = data.draw(st.integers(0, 5))

    def rank_main():
        me = dist.get_rank()
        sub = dist.new_group(pair)
        if me not in pair:
            return None
        if me == sender:
            dist.send(np.full(3, float(me)), group=sub, group_dst=1 - sub.rank, tag=tag)
            return None
        got = np.empty(3)
        return dist.recv(got, group=sub, tag=tag), got.tolist()

    results = run_world(size, rank_main)
    receiver = pair[1 - pair.index(sender)]
    assert results[receiver] == (sender, [float(sender)] * 3)


def test_recv_without_src_takes_each_message_once_from_whichever_rank_sends_it():
    """A work queue at 4 ranks: rank 0 receives from any rank, through recv and irecv, in a
    subgroup too; each sender's messages come in the order it sent them."""

    def rank_main():
        me = dist.get_rank()
        odd = dist.new_group([0, 1, 3])
        if me != 0:
            for i in range(3):
                dist.send(np.array([me, i], np.float64), dst=0, tag=4)
            if me in (1, 3):
                dist.send(np.array([me * 100.0, 0.0]), group=odd, group_dst=0)
            return None
        seen = []
        for i in range(9):
            got = np.zeros(2)
            if i % 2:
                work = dist.irecv(got, tag=4)
                work.wait()
                sender = work.source
            else:
                sender = dist.recv(got, tag=4)
            assert got[0] == sender
            seen.append((sender, int(got[1])))
        late = []
        for _ in range(2):
            got = np.zeros(2)
            late.append((dist.recv(got, group=odd), got[0]))  # a global rank, though received on a subgroup
        return seen, sorted(late)

    seen, late = run_world(4, rank_main)[0]
    for sender in (1, 2, 3):
        assert [i for s, i in seen if s == sender] == [0, 1, 2]
    assert late == [(1, 100.0), (3, 300.0)]


def test_recv_without_src_over_two_levels():
    def rank_main():
        me = dist.get_rank()
        if me:
            dist.send(np.array([float(me)]), dst=0)
            return None
        got = []
        for _ in range(3):
            x = np.zeros(1)
            got.append((dist.recv(x), x[0]))
        return sorted(got)

    assert run_world(4, rank_main, nodes=[2, 2])[0] == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_recv_without_src_and_a_receive_naming_the_sender_take_messages_in_the_order_posted():
    def rank_main():
        me = dist.get_rank()
        if me == 2:
            dist.barrier()
            dist.send(np.array([1.0]), dst=0)
            dist.send(np.array([2.0]), dst=0)
        elif me == 1:
            dist.barrier()
        else:
            anyone, named = np.zeros(1), np.zeros(1)
            first = dist.irecv(anyone)
            second = dist.irecv(named, src=2)
            dist.barrier()
            first.wait()
            second.wait()
            return first.source, anyone[0], second.source, named[0]
        return None

    assert run_world(3, rank_main)[0] == (2, 1.0, 2, 2.0)


def test_recv_without_src_in_a_group_of_one_or_past_its_deadline_says_so():
    def rank_main():
        me = dist.get_rank()
        alone = dist.new_group([me])
        with pytest.raises(InvalidRank, match="no other rank to receive from"):
            dist.recv(np.zeros(1), group=alone)
        if me == 0:
            with pytest.raises(CollectiveTimeout, match=r"any of ranks \[1, 2\]") as info:
                dist.recv(np.zeros(1), timeout=0.3)
            assert info.value.waiting_for == (1, 2)
        dist.barrier()

    run_world(3, rank_main)


# -- monitored_barrier, barrier(device_ids), get_backend, is_available, group.WORLD ----------------
@settings(max_examples=examples(10))
@given(size=SIZES, data=st.data())
def test_monitored_barrier_returns_when_everyone_came(size, data):
    members = data.draw(subgroups(size))
    late = data.draw(st.sampled_from(members))

    def rank_main():
        sub = dist.new_group(members)
        if dist.get_rank() not in members:
            return None
        if dist.get_rank() == late:
            time.sleep(0.05)
        dist.monitored_barrier(sub, timeout=datetime.timedelta(seconds=10))
        return "passed"

    assert [r for r in run_world(size, rank_main) if r] == ["passed"] * len(members)


@pytest.mark.parametrize("wait_all_ranks", [False, True])
def test_monitored_barrier_names_who_did_not_come_and_fails_every_rank(wait_all_ranks):
    absent = (2, 3)

    def rank_main():
        me = dist.get_rank()
        if me in absent:
            time.sleep(1.5)  # busy elsewhere; then arrives late
            with pytest.raises(GroupAborted):
                dist.monitored_barrier(timeout=10)
            return None
        start = time.monotonic()
        with pytest.raises((CollectiveTimeout, FerrodistError)) as info:
            dist.monitored_barrier(timeout=0.5, wait_all_ranks=wait_all_ranks)
        return str(info.value), info.value, time.monotonic() - start

    results = run_world(4, rank_main)
    rank0_message, rank0_error, took = results[0]
    named = "ranks [2, 3] did not arrive within 0.5 s" if wait_all_ranks else "rank 2 did not arrive within 0.5 s"
    assert named in rank0_message
    assert isinstance(rank0_error, CollectiveTimeout)
    assert set(rank0_error.waiting_for) == {2, 3}
    assert took < 0.5 + 1.0  # the deadline plus the stated slack
    message, _, took = results[1]
    assert "rank 0 aborted the group" in message and named in message
    assert took < 0.5 + 1.0


def test_barrier_takes_device_ids_and_ignores_them_on_cpu():
    def rank_main():
        dist.barrier(device_ids=[dist.get_rank()])
        dist.barrier(None, False, [0], datetime.timedelta(seconds=5))  # torch's positional order
        with pytest.raises(InvalidArgument, match="device_ids must be a list of GPU indices"):
            dist.barrier(device_ids="cuda:0")
        return "ok"

    assert run_world(2, rank_main) == ["ok", "ok"]


def test_get_backend_is_available_and_group_world():
    def rank_main():
        world = dist.group.WORLD
        x = np.array([dist.get_rank() + 1.0])
        dist.all_reduce(x, group=world)
        objs = [None] * 3
        dist.all_gather_object(objs, dist.get_rank(), group=world)
        got = np.empty(1)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, x, (dist.get_rank() + 1) % 3, group=world),
                dist.P2POp(dist.irecv, got, (dist.get_rank() - 1) % 3, group=world),
            ]
        )
        for work in works:
            work.wait(5)
        return (
            dist.get_backend(),
            dist.get_backend(world),
            dist.is_available(),
            x[0],
            objs,
            got[0],
            dist.get_rank(world),
            world.size,
            repr(world),
        )

    for rank, result in enumerate(run_world(3, rank_main)):
        assert result == ("simulated", "simulated", True, 6.0, [0, 1, 2], 6.0, rank, 3, repr(dist.group.WORLD))
    assert "default process group" in repr(dist.group.WORLD)


def test_get_backend_names_the_transport_of_real_backends():
    import socket

    from ferrodist.transport import TcpTransport

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    transport = TcpTransport.connect(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, timeout=10)
    group = dist.ProcessGroup(transport, [0], 99, timeout=10, name="tcp-probe")
    try:
        assert dist.get_backend(group) == "tcp"
    finally:
        group._shutdown()
        transport.close()


# -- timeouts as timedelta -----------------------------------------------------------------------
def test_timeouts_may_be_timedeltas_everywhere():
    def rank_main():
        me = dist.get_rank()
        sub = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=7))
        assert sub.timeout == 7.0
        x = np.ones(2)
        dist.all_reduce(x, timeout=datetime.timedelta(seconds=5))
        work = dist.broadcast(x, 0, async_op=True, timeout=datetime.timedelta(seconds=5))
        work.wait(datetime.timedelta(seconds=5))
        dist.send(x, 1 - me, timeout=datetime.timedelta(seconds=5)) if me == 0 else dist.recv(
            x, 0, timeout=datetime.timedelta(seconds=5)
        )
        dist.all_to_all_single(np.empty(2), np.ones(2), timeout=datetime.timedelta(seconds=5))
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=5))
        dist.all_gather_object([None, None], me, timeout=datetime.timedelta(seconds=5))
        return x[0]

    assert run_world(2, rank_main) == [2.0, 2.0]


@pytest.mark.parametrize("bad", [datetime.timedelta(0), datetime.timedelta(seconds=-1), 0, -2.5, float("inf")])
def test_zero_negative_and_endless_timeouts_are_refused_clearly_everywhere(bad):
    def rank_main():
        me = dist.get_rank()
        calls = {
            "all_reduce": lambda: dist.all_reduce(np.ones(1), timeout=bad),
            "barrier": lambda: dist.barrier(timeout=bad),
            "send": lambda: dist.send(np.ones(1), 1 - me, timeout=bad),
            "recv": lambda: dist.recv(np.ones(1), 1 - me, timeout=bad),
            "new_group": lambda: dist.new_group([0, 1], timeout=bad),
            "monitored_barrier": lambda: dist.monitored_barrier(timeout=bad),
            "all_gather_object": lambda: dist.all_gather_object([None, None], 1, timeout=bad),
            "all_to_all_single": lambda: dist.all_to_all_single(np.empty(2), np.ones(2), timeout=bad),
        }
        for name, call in calls.items():
            with pytest.raises(InvalidArgument, match=rf"rank {me}: {name}: timeout must be a positive number"):
                call()
        if bad != 0 and bad != datetime.timedelta(0):
            work = dist.all_reduce(np.ones(1), async_op=True)
            with pytest.raises(InvalidArgument, match=r"Work\.wait: timeout must be a number of seconds >= 0"):
                work.wait(bad)
            work.wait(5)
        x = np.ones(1)
        dist.all_reduce(x)  # the refused calls sent nothing
        return x[0]

    assert run_world(2, rank_main) == [2.0, 2.0]


def test_init_process_group_takes_a_timedelta_and_refuses_zero():
    if dist.is_initialized():
        pytest.skip("a default group exists in this process")
    with pytest.raises(InvalidArgument, match="init_process_group: timeout must be a positive number"):
        dist.init_process_group("simulated", timeout=datetime.timedelta(0))
    world = dist.init_process_group("simulated", timeout=datetime.timedelta(minutes=2))
    try:
        assert world.timeout == 120.0
        assert dist.get_backend() == "simulated"
    finally:
        dist.destroy_process_group(dist.group.WORLD)
    assert not dist.is_initialized()


# -- the order of calls ------------------------------------------------------------------------------
def test_the_new_calls_take_one_call_number_each_and_keep_their_turn_among_async_calls():
    """all_to_all_single is one call of two steps; an object collective is two calls of the
    group's (sizes, then bytes), as in torch: async calls issued before and after them run
    in their turn around them."""

    def rank_main():
        me = dist.get_rank()
        a = np.full(1000, me + 1.0)
        first = dist.all_reduce(a, async_op=True)  # call #0
        objects = [None] * 3
        dist.all_gather_object(objects, {"rank": me, "blob": bytes(2000)})  # calls #1 and #2
        b = np.full(10, float(me))
        second = dist.all_reduce(b, async_op=True)  # call #3
        out = np.empty((3, 2))
        dist.all_to_all_single(out, np.full((3, 2), float(me)))  # call #4
        first.wait(10)
        second.wait(10)
        with pytest.raises(FerrodistError) as info:  # call #5: ranks disagree on purpose
            if me == 0:
                dist.barrier()
            else:
                dist.all_reduce(np.ones(1))
        return a[0], [o["rank"] for o in objects], b[0], out[:, 0].tolist(), str(info.value)

    for result in run_world(3, rank_main, timeout=10):
        assert result[:4] == (6.0, [0, 1, 2], 3.0, [0.0, 1.0, 2.0])
        assert " #5 on group world" in result[4], result[4]


def test_every_new_operation_has_a_fingerprint_of_its_own():
    from ferrodist.collectives._fingerprint import OPERATIONS, describe, fingerprint

    names = ["all_to_all_single", "monitored_barrier"]  # the object collectives are made of the others
    prints = {fingerprint(n) for n in OPERATIONS}
    assert len(prints) == len(OPERATIONS) == 12  # with the setup of a group's CUDA route
    for name in names:
        assert describe(fingerprint(name)) == f"{name}()"


# -- real processes --------------------------------------------------------------------------------
SCRIPT = Path(__file__).parents[1] / "integration" / "scripts" / "torch_calls.py"


@pytest.mark.parametrize(("backend", "ranks"), [("tcp", 3), ("shm", 2)])
def test_every_call_between_real_processes(backend, ranks):
    done = subprocess.run(
        [sys.executable, "-m", "ferrodist.launch", "run", "-n", str(ranks), str(SCRIPT), backend],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(ranks):
        assert f"[rank {rank}] rank {rank} of {ranks}: 16 checks of torch's calls passed over {backend}" in done.stdout


def test_every_call_under_mpiexec():
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if mpiexec is None or importlib.util.find_spec("mpi4py") is None:
        if os.environ.get("FERRODIST_REQUIRE_MPI") == "1":
            pytest.fail("mpi4py / mpiexec are missing but FERRODIST_REQUIRE_MPI=1")
        pytest.skip("mpi4py and mpiexec are not installed (pip install -e './packages/transport[mpi]')")
    command = [mpiexec, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, str(SCRIPT), "mpi"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(2):
        assert f"rank {rank} of 2: 16 checks of torch's calls passed over mpi" in done.stdout


# -- rank translation: get_group_rank, get_global_rank, get_process_group_ranks -----------------------
@settings(max_examples=examples(15))
@given(size=SIZES, data=st.data())
def test_rank_translation_against_the_members_list(size, data):
    members = data.draw(subgroups(size))

    def rank_main():
        sub = dist.new_group(list(reversed(members)))  # any order: a group's ranks are sorted
        world = dist.group.WORLD
        me = dist.get_rank()
        got = {
            "ranks": dist.get_process_group_ranks(sub),
            "world": dist.get_process_group_ranks(),
            "group_ranks": [dist.get_group_rank(sub, r) for r in members],
            "global_ranks": [dist.get_global_rank(sub, i) for i in range(len(members))],
            "identity": [dist.get_group_rank(world, me), dist.get_global_rank(None, me)],
        }
        outsider = next((r for r in range(size) if r not in members), None)
        if outsider is not None:
            with pytest.raises(InvalidRank, match=rf"global rank {outsider} is not in group"):
                dist.get_group_rank(sub, outsider)
        with pytest.raises(InvalidRank, match=rf"get_global_rank: group rank {len(members)} is not in group"):
            dist.get_global_rank(sub, len(members))
        return got

    reference = sorted(members)
    for me, got in enumerate(run_world(size, rank_main)):
        assert got == {
            "ranks": reference,
            "world": list(range(size)),
            "group_ranks": [reference.index(r) for r in members],
            "global_ranks": reference,
            "identity": [me, me],
        }


# -- all_gather_single, reduce_scatter_single: torch's newer names ---------------------------------------
@settings(max_examples=examples(10))
@given(data=st.data(), size=SIZES, stacked=st.booleans(), async_op=st.booleans())
def test_all_gather_single_and_reduce_scatter_single_are_the_tensor_calls(data, size, stacked, async_op):
    dt = data.draw(st.sampled_from(ALL_DTYPES))
    block = data.draw(st.sampled_from([(3,), (2, 2)]))
    whole = (size, *block) if stacked else (size * block[0], *block[1:])
    parts = data.draw(world_inputs(size, dt, block))
    wholes = data.draw(world_inputs(size, dt, whole, low=-2.0, high=2.0))
    gathered = ref_all_gather_into_tensor(parts, stacked=stacked)
    scattered = ref_reduce_scatter_tensor(wholes, ReduceOp.SUM, stacked=stacked)

    def rank_main():
        me = dist.get_rank()
        out = np.zeros_like(gathered[0])
        finish(dist.all_gather_single(out, parts[me], None, async_op))
        mine = np.zeros(block, dt.numpy)
        finish(dist.reduce_scatter_single(mine, wholes[me], ReduceOp.SUM, None, async_op))
        return out, mine

    results = run_world(size, rank_main)
    for r, (out, mine) in enumerate(results):
        np.testing.assert_array_equal(out, gathered[r])
        blocks = [w[r] if stacked else w[r * block[0] : (r + 1) * block[0]] for w in wholes]
        assert_reduced(mine, blocks, ReduceOp.SUM, what=f"rank {r}")
        assert mine.shape == scattered[r].shape
    assert_same_bits([out for out, _ in results])


# -- new_subgroups ----------------------------------------------------------------------------------
@settings(max_examples=examples(10))
@given(size=st.sampled_from([1, 2, 4, 6]), data=st.data())
def test_new_subgroups_cuts_the_group_into_consecutive_blocks(size, data):
    group_size = data.draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))

    def rank_main():
        mine, every = dist.new_subgroups(group_size)
        x = np.array([dist.get_rank() + 1.0])
        dist.all_reduce(x, group=mine)
        return mine.ranks, [g.ranks for g in every], x[0]

    blocks = [tuple(range(start, start + group_size)) for start in range(0, size, group_size)]
    for me, (mine, every, total) in enumerate(run_world(size, rank_main)):
        assert every == blocks
        assert me in mine and mine in blocks
        assert total == sum(r + 1 for r in mine)


def test_new_subgroups_of_a_subgroup_and_its_outsiders():
    """Every rank of the world makes every subgroup (as for new_group): one outside the
    group it cuts raises InvalidRank afterwards, and the groups made later still agree."""

    def rank_main():
        me = dist.get_rank()
        parent = dist.new_group([1, 2, 3, 4])
        if me in (1, 2, 3, 4):
            mine, every = dist.new_subgroups(2, parent, timeout=datetime.timedelta(seconds=9))
            assert mine.timeout == 9.0
            found = (mine.ranks, [g.ranks for g in every])
        else:
            with pytest.raises(InvalidRank, match=r"rank 0: new_subgroups: this rank is not in group"):
                dist.new_subgroups(2, parent)
            found = None
        later = dist.new_group([0, 4])
        x = np.ones(1)
        if me in (0, 4):
            dist.all_reduce(x, group=later)
        return found, x[0]

    results = run_world(5, rank_main)
    assert results[0] == (None, 2.0) and results[4][1] == 2.0
    assert results[1][0] == results[2][0] == ((1, 2), [(1, 2), (3, 4)])
    assert results[3][0] == ((3, 4), [(1, 2), (3, 4)])


def test_new_subgroups_refuses_sizes_that_do_not_split_the_group_before_making_any():
    def rank_main():
        with pytest.raises(
            InvalidArgument, match=r"has 3 ranks, which do not split into groups of 2; pass a group_size"
        ):
            dist.new_subgroups(2)
        with pytest.raises(InvalidArgument, match=r"group_size must be a positive integer, not 0"):
            dist.new_subgroups(0)
        with pytest.raises(
            InvalidArgument, match=r"pass group_size .* no launcher said how many ranks run on this host"
        ):
            dist.new_subgroups()
        mine, _ = dist.new_subgroups(3)  # nothing was made before: the group ids still agree
        x = np.ones(1)
        dist.all_reduce(x, group=mine)
        return x[0]

    assert run_world(3, rank_main) == [3.0, 3.0, 3.0]


def test_new_subgroups_without_a_size_takes_the_ranks_of_each_host(monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", "29500")

    def rank_main():
        mine, every = dist.new_subgroups()
        return mine.ranks, len(every)

    assert run_world(4, rank_main) == [((0, 1), 2), ((0, 1), 2), ((2, 3), 2), ((2, 3), 2)]


# -- send_object_list, recv_object_list --------------------------------------------------------------
@settings(max_examples=examples(15))
@given(data=st.data(), size=st.integers(2, 5))
def test_send_and_recv_object_list_against_the_objects(data, size):
    sender, receiver = data.draw(st.lists(st.integers(0, size - 1), min_size=2, max_size=2, unique=True))
    objects = data.draw(st.lists(picklable_objects(), max_size=4))

    def rank_main():
        me = dist.get_rank()
        if me == sender:
            dist.send_object_list(objects, dst=receiver)
        elif me == receiver:
            out = ["before"] * len(objects)
            return dist.recv_object_list(out, src=sender), out
        return None

    assert run_world(size, rank_main)[receiver] == (sender, objects)


def test_recv_object_list_from_any_source_in_a_group_of_two_and_by_group_rank():
    def rank_main():
        me = dist.get_rank()
        pair = dist.new_group([1, 3])
        if me == 3:
            dist.send_object_list([{"from": me}, (me,)], group=pair, group_dst=0)
            dist.send_object_list(["again"], dst=1, group=pair, device="cpu", use_batch=True)
        elif me == 1:
            first, second = [None, None], [None]
            return dist.recv_object_list(first, group=pair), first, dist.recv_object_list(second, 3, pair), second
        return None

    assert run_world(4, rank_main)[1] == (3, [{"from": 3}, (3,)], 3, ["again"])


def test_object_lists_that_fail_raise_at_both_ends_and_leave_no_message_behind():
    def rank_main():
        me = dist.get_rank()
        if me == 0:
            with pytest.raises(InvalidArgument, match=r"rank 0: send_object_list: object_list\[1\] cannot be pickled"):
                dist.send_object_list([1, Unpicklable()], dst=1)
            dist.send_object_list([1, 2, 3], dst=1)  # one entry too many for the receiver
            dist.send_object_list([LoadsNowhere()], dst=1)
            dist.send_object_list(["fine"], dst=1)
            return None
        errors = []
        for expected, count in (
            (InvalidArgument, 2),
            (InvalidArgument, 2),
            (ProtocolError, 1),
        ):
            out = ["kept"] * count
            with pytest.raises(expected) as info:
                dist.recv_object_list(out, src=0)
            assert out == ["kept"] * count
            errors.append(str(info.value))
        out = [None]
        dist.recv_object_list(out, src=0)  # every message of the refused calls was taken
        return errors, out

    errors, out = run_world(2, rank_main)[1]
    assert out == ["fine"]
    assert "rank 1: recv_object_list: object_list[1] on rank 0 cannot be pickled" in errors[0]
    assert "rank 0 sent 3 objects but object_list has 2 entries" in errors[1]
    assert "object 0 from rank 0 cannot be unpickled here" in errors[2] and "only_on_rank_1" in errors[2]
