"""``ferrodist.elastic``: a State committed in memory, restored in place and synced from a
peer; ``run`` recovering from a lost rank without a restart, to the bit of a reference run
that replays the same membership from the same commit (float64, data chosen by step and
rank), over ferrodist.nn with DDP and over a PyTorch module."""

from __future__ import annotations

import numpy as np
import pytest

import ferrodist.collectives as dist
from ferrodist import nn
from ferrodist.core import Excluded, FerrodistError, InvalidArgument
from ferrodist.ddp import DDP
from ferrodist.elastic import State, run
from ferrodist.testing import run_world

STEPS, EVERY = 20, 5


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 6, rng=1), nn.Tanh(), nn.Linear(6, 2, rng=2))


def _batch(step: int, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's shard of step ``step``'s batch: chosen by (step, rank, size) alone."""
    rng = np.random.default_rng([step, rank, size])
    return rng.normal(size=(4, 3)), rng.normal(size=(4, 2))


def _steps(state: State, until: int, group, lose: tuple[int, int] | None = None) -> None:
    """Train ``state`` to step ``until`` on ``group`` (DDP rebuilt over it); with ``lose``
    = (global rank, step), that rank closes its transport at that step (a killed process)."""
    net, opt = state.model, state.optimizer
    ddp = DDP(net, group)
    loss_fn = nn.MSELoss(reduction="sum")
    while state.step < until:
        if lose is not None and (group.global_rank, state.step) == lose:
            group.transport.close()
            raise SystemExit  # this rank is gone
        x, y = _batch(state.step, group.rank, group.size)
        loss_fn(ddp(x), y)
        ddp.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
        state.step += 1
        if state.step % EVERY == 0:
            state.commit()


def _parameters(net) -> list[np.ndarray]:
    return [p.data.copy() for p in net.parameters()]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_a_recovered_run_equals_the_replay_of_its_membership_to_the_bit(size):
    victim, lost_at = size - 1 if size > 2 else 0, 13  # lost after commit #2 (step 10)

    def elastic_job():
        net = _model()
        state = State(model=net, optimizer=nn.SGD(net.parameters(), lr=0.05, momentum=0.9), step=0)
        recoveries = []
        try:
            run(
                lambda s: _steps(s, STEPS, s.group, lose=(victim, lost_at)),
                state,
                timeout=10,
                on_recovery=lambda s, exc: recoveries.append((s.step, s.group.ranks)),
            )
        except SystemExit:
            return None
        return _parameters(net), recoveries, state.step

    def reference_first_part():
        net = _model()
        state = State(model=net, optimizer=nn.SGD(net.parameters(), lr=0.05, momentum=0.9), step=0)
        _steps(state, 10, dist.default_group())
        return net.state_dict(), state.optimizer.state_dict()

    elastic = run_world(size, elastic_job)
    first = run_world(size, reference_first_part)
    live = [r for r in range(size) if r != victim]

    def reference_second_part():
        net = _model()
        opt = nn.SGD(net.parameters(), lr=0.05, momentum=0.9)
        net.load_state_dict(first[0][0])
        opt.load_state_dict(first[0][1])
        state = State(model=net, optimizer=opt, step=10)
        _steps(state, STEPS, dist.default_group())
        return _parameters(net)

    replay = run_world(len(live), reference_second_part)
    for new_rank, rank in enumerate(live):
        params, recoveries, step = elastic[rank]
        assert recoveries == [(10, tuple(live))]
        assert step == STEPS
        for got, want in zip(params, replay[new_rank], strict=True):
            assert np.array_equal(got, want)  # bit for bit
    assert elastic[victim] is None


def test_sync_sends_the_newest_commit_to_ranks_that_lack_it():
    def job():
        group = dist.default_group()
        net = _model()
        state = State(group, model=net, step=0)
        if group.rank == 1:
            for p in net.parameters():
                p.data += 1.0
            state.step = 7
            state.commit()
            state.commit()  # commit #2 here, #0 or #1 elsewhere
        elif group.rank == 2:
            state.commit()
        source = state.sync()
        return source, state.step, state.commits, [float(p.data.sum()) for p in net.parameters()]

    results = run_world(3, job)
    assert [r[:3] for r in results] == [(1, 7, 2)] * 3
    assert results[0][3] == results[1][3] == results[2][3]


def test_with_roles_each_rank_gets_the_newest_commit_of_its_role_and_a_role_with_none_fails_everywhere():
    """Two roles (the stages of a pipeline), ranks 0, 2 and 1, 3: rank 2 and rank 3 are behind
    (one stood by, one is new); each gets its own role's newest commit, from its role's
    lowest holder. With no holder of role 1 left, sync raises on every rank."""

    def job():
        group = dist.default_group()
        net = _model()
        for p in net.parameters():
            p.data[...] = 10.0 * (group.rank % 2)  # role 0 holds zeros, role 1 tens
        state = State(group, model=net, step=0, role=lambda rank: rank % 2)
        commits = {0: 2, 1: 3, 2: 1, 3: 0}[group.rank]
        for _ in range(commits):
            state.step += 1
            state.commit()
        if group.rank >= 2:  # behind: what they hold now is not what their role committed last
            for p in net.parameters():
                p.data[...] = -1.0
        source = state.sync()
        values = {float(v) for p in net.parameters() for v in p.data.ravel()}
        lost = State(group, step=0, role=lambda rank: rank % 2)
        if group.rank % 2 == 0:
            lost.commit()
        with pytest.raises(InvalidArgument, match=r"role 1 \(ranks \[1, 3\]\) holds a commit"):
            lost.sync()
        return source, state.step, state.commits, values

    assert run_world(4, job) == [(0, 2, 2, {0.0}), (1, 3, 3, {10.0}), (0, 2, 2, {0.0}), (1, 3, 3, {10.0})]


def test_state_values_objects_and_errors():
    def job():
        net = _model()
        state = State(model=net, step=3, note="a")
        with pytest.raises(InvalidArgument, match="nothing was committed"):
            state.restore()
        state.commit()
        state.step, state.note = 9, "b"
        before = net.parameters()[0].data
        before[...] = 0.0
        state.restore()
        assert (state.step, state.note) == (3, "a")
        assert net.parameters()[0].data is before and before.any()  # restored in place
        with pytest.raises(InvalidArgument, match="in place"):
            state.model = _model()
        with pytest.raises(AttributeError, match="no entry"):
            _ = state.missing
        with pytest.raises(InvalidArgument, match="what to keep"):
            State()
        return True

    assert run_world(1, job) == [True]


def test_a_bug_in_train_or_an_invalid_argument_is_not_retried_and_max_failures_is_kept():
    def job():
        state = State(step=0)
        calls = []

        def buggy(s):
            calls.append(1)
            raise ValueError("a bug")

        with pytest.raises(ValueError, match="a bug"):
            run(buggy, state)

        def failing(s):
            calls.append(2)
            raise FerrodistError("lost")

        with pytest.raises(FerrodistError, match="lost"):
            run(failing, state, max_failures=0)

        def misused(s):
            calls.append(3)
            raise InvalidArgument("a wrong argument, the same on every try")

        with pytest.raises(InvalidArgument, match="every try"):
            run(misused, state)  # no shrink, no second call
        return calls

    assert run_world(2, job) == [[1, 2, 3], [1, 2, 3]]


def test_a_rank_left_out_gets_excluded_out_of_run():
    """Rank 2 of 3 stops past the others' timeout: they go on; when it wakes up, its next
    call fails and ``run`` raises Excluded instead of training alone."""
    import time

    def job():
        group = dist.default_group()
        state = State(step=0)

        def train(s):
            while s.step < 6:
                if s.group.global_rank == 2 and s.step == 2:
                    time.sleep(3.0)
                s.group.all_reduce(np.ones(3), timeout=0.5)
                s.step += 1
                s.commit()
            return s.group.ranks

        try:
            return run(train, state, timeout=10, window=0.5)
        except Excluded as exc:
            return ("excluded", exc.survivors, group.rank)

    results = run_world(3, job)
    assert results[0] == results[1] == (0, 1)
    assert results[2] == ("excluded", (0, 1), 2)


def test_a_torch_module_and_optimizer_recover_with_ferrodist_ddp():
    torch = pytest.importorskip("torch")

    def job():
        torch.manual_seed(0)
        net = torch.nn.Linear(3, 2).double()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        state = State(model=net, optimizer=opt, step=0)

        def train(s):
            ddp = DDP(net, s.group)
            while s.step < 8:
                if s.group.global_rank == 1 and s.step == 6:
                    s.group.transport.close()
                    raise SystemExit
                g = torch.Generator().manual_seed(s.step * 10 + s.group.rank)
                x = torch.randn(4, 3, dtype=torch.float64, generator=g)
                ddp(x).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
                s.step += 1
                if s.step % 4 == 0:
                    s.commit()
            return [p.detach().clone() for p in net.parameters()]

        try:
            return run(train, state, timeout=10)
        except SystemExit:
            return None

    results = run_world(3, job)
    assert results[1] is None
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[2], strict=True))
