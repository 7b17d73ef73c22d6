"""``Twin``: a compiled loop and its interpreted twin called as one: the twin (and the compile
queued) until the compiled code is loaded, then the compiled code; both give the same bits."""

from __future__ import annotations

import numpy as np

from ferrodist.core.kernels import PLAIN, SUM, Twin, fold_numpy, jit, prepare, wait_for_compiles


@jit
def _scaled_sum(out, a, b, scale):  # type: ignore[no-untyped-def]
    for i in range(out.shape[0]):
        out[i] = (a[i] + b[i]) / scale
    return out.shape[0]


def _scaled_sum_numpy(out, a, b, scale):  # type: ignore[no-untyped-def]
    np.divide(a + b, scale, out=out)
    return out.shape[0]


def test_a_twin_runs_its_interpreted_half_until_the_compiled_one_is_loaded():
    used: list[int] = []

    def interpreted(out, a, b, scale):  # type: ignore[no-untyped-def]
        used.append(out.shape[0])
        return _scaled_sum_numpy(out, a, b, scale)

    twin = Twin(_scaled_sum, interpreted)
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal(1001).astype(np.float32), rng.standard_normal(1001).astype(np.float32)
    first, later = np.empty_like(a), np.empty_like(a)
    assert not twin.ready(first, a, b, 3.0)
    assert twin(first, a, b, 3.0) == 1001  # the return value comes back from either half
    assert used == [1001], "the first call ran the interpreted half (the compile was queued)"
    assert wait_for_compiles(120)
    assert twin.ready(later, a, b, 3.0)
    assert twin(later, a, b, 3.0) == 1001
    assert used == [1001], "once loaded, the compiled half runs"
    assert np.array_equal(first, later), "both halves give the same bits"
    assert "Twin(_scaled_sum, interpreted: " in repr(twin)


def test_the_fold_twin_agrees_with_numpy_to_the_bit():
    from ferrodist.core._reduce import fold_twin

    twin = fold_twin(PLAIN, SUM, True, -1)
    rng = np.random.default_rng(11)
    srcs = tuple(rng.standard_normal(4097) for _ in range(3))
    assert twin.front is not None
    prepare([(twin.front, tuple(twin.front.typeof_pyval(v) for v in (np.empty(4097), srcs, 3.0)))])
    assert wait_for_compiles(120)
    compiled, reference = np.empty(4097), np.empty(4097)
    assert twin.ready(compiled, srcs, 3.0)
    twin(compiled, srcs, 3.0)
    fold_numpy(PLAIN, SUM, True, reference, srcs, 3.0)
    assert np.array_equal(compiled, reference)


@jit
def _scaled_difference(out, a, b, scale):  # type: ignore[no-untyped-def]
    for i in range(out.shape[0]):
        out[i] = (a[i] - b[i]) / scale
    return out.shape[0]


def test_a_driver_that_calls_a_front_first_falls_back_whole_and_later_waits_for_its_misses():
    from ferrodist.core.kernels import Later, background

    front = background(_scaled_difference)
    types = tuple(front.typeof_pyval(v) for v in (np.empty(3), np.ones(3), np.ones(3), 2.0))
    policy = Later(lambda: [(front, types)], 3)
    ran: list[int] = []

    def driver(out, a, b, scale):  # type: ignore[no-untyped-def]
        n = front(out, a, b, scale)  # raises NotCompiled before the driver does anything
        ran.append(n)
        return n

    def interpreted(out, a, b, scale):  # type: ignore[no-untyped-def]
        np.divide(a - b, scale, out=out)
        return out.shape[0]

    twin = Twin(driver, interpreted, queue=policy.missed)
    assert twin.front is None and "driver" in repr(twin)
    out, a, b = np.empty(3), np.full(3, 5.0), np.ones(3)
    for misses in (1, 2):
        assert twin(out, a, b, 2.0) == 3
        assert policy.misses == misses and not policy.queued, "nothing queued before `after` misses"
    assert twin(out, a, b, 2.0) == 3
    assert policy.queued and ran == []
    assert wait_for_compiles(120)
    out[...] = 0
    assert twin(out, a, b, 2.0) == 3
    assert ran == [3] and np.array_equal(out, np.full(3, 2.0)), "the driver ran the compiled loop"
