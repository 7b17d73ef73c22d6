"""Communication hooks: how a bucket's gradients are averaged across the group.

A hook is any callable ``hook(bucket) -> Work``: it starts the exchange of
``bucket.buffer`` and returns a handle whose ``wait()`` leaves the group's average in
``bucket.buffer``. The built-in hooks:

- ``allreduce`` (the default): one all_reduce with ``ReduceOp.AVG``.
- ``fp16_compress`` / ``bf16_compress``: scale by 1/size, cast to 16 bits, all_reduce the
  half-size buffer (float32 accumulation inside ferrodist's reductions), cast back. A
  float32 bucket on the host goes to ``bf16_compress`` as one ``all_reduce(...,
  compress="bf16")`` with AVG, which rounds inside the transport's loop (shared memory) or
  around the call (tcp): no scaling pass, no buffer of its own.
- ``powersgd(rank=r)``: PowerSGD (Vogels et al., 2019) with error feedback and warm start;
  matrices are sent as two thin factors, vectors uncompressed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ferrodist.core import Group, ReduceOp, Work, host_view

if TYPE_CHECKING:
    from ._models import Model


__all__ = ["GradBucket", "PowerSGD", "allreduce", "bf16_compress", "fp16_compress", "powersgd"]


@dataclass
class GradBucket:
    """What a hook sees of one bucket. ``buffer`` is the flat gradient buffer (a numpy array
    or a torch tensor); ``views[i]`` is parameter ``names[i]``'s gradient inside it;
    ``state`` is kept across steps for the hook's own use (scratch buffers, error feedback).
    ``shadow`` is true on a rank that has run out of inputs inside ``join()``: its buffer
    is zeros, and a hook must contribute nothing else."""

    index: int
    buffer: Any
    views: tuple[Any, ...]
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group: Group
    ops: Model  # the array operations of the model's framework (numpy or torch)
    is_last: bool
    shadow: bool = False
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """Ranks in the group."""
        return self.group.size

    def scratch(self, key: str, numel: int, dtype: str) -> Any:
        """A buffer kept in ``state`` under ``key`` (allocated on first use, like ``buffer``)."""
        buf = self.state.get(key)
        if buf is None:
            buf = self.state[key] = self.ops.empty(self.buffer, numel, dtype)
        return buf


class _Then:
    """A ``Work`` that runs ``after()`` once the inner work is done, on the waiting thread."""

    def __init__(self, inner: Work | None, after: Callable[[], None]) -> None:
        self._inner = inner
        self._after: Callable[[], None] | None = after

    def wait(self, timeout: float | None = None) -> None:
        if self._inner is not None:
            self._inner.wait(timeout)
        if self._after is not None:
            after, self._after = self._after, None
            after()

    def is_completed(self) -> bool:
        return self._after is None


def allreduce(bucket: GradBucket) -> Work:
    """The default hook: the group's average of the bucket, in place."""
    work = bucket.group.all_reduce(bucket.buffer, ReduceOp.AVG, async_op=True)
    assert work is not None
    return work


def _compress(bucket: GradBucket, dtype: str) -> Work:
    # Scaled in place (the average overwrites the buffer anyway), then rounded once into the
    # 16-bit buffer kept for the bucket: no allocation per step, one pass each way.
    wire = bucket.scratch(f"compress.{dtype}", len(bucket.buffer), dtype)
    bucket.ops.scale_(bucket.buffer, 1.0 / bucket.size)
    bucket.ops.copy(wire, bucket.buffer)
    work = bucket.group.all_reduce(wire, ReduceOp.SUM, async_op=True)
    return _Then(work, lambda: bucket.ops.copy(bucket.buffer, wire))


def fp16_compress(bucket: GradBucket) -> Work:
    """Average in float16: half the bytes of float32. Values are scaled by 1/size before the
    cast so the sum cannot overflow; float16 keeps 11 significant bits and a range to 65504."""
    return _compress(bucket, "float16")


def bf16_compress(bucket: GradBucket) -> Work:
    """Average in bfloat16: half the bytes of float32, float32's range, 8 significant bits."""
    x = host_view(bucket.buffer)
    if x is not None and x.dtype == np.float32:  # rounded, averaged and widened by the group
        work = bucket.group.all_reduce(bucket.buffer, ReduceOp.AVG, async_op=True, compress="bf16")
        assert work is not None
        return work
    return _compress(bucket, "bfloat16")


class PowerSGD:
    """PowerSGD (Vogels, Karimireddy, Jaggi 2019): each gradient matrix M (n x m, from any
    tensor of two or more dimensions) is sent as P = M Q (n x r) and Q = M^T P (m x r), r
    much smaller than n and m, with error feedback (what compression lost is added to the
    next step's gradient) and warm start (Q carries over between steps).

    Args:
        rank: r, the rank of the approximation (1 to 4 is typical).
        start_iter: the first this many synchronised steps use a plain all_reduce (PowerSGD
            helps only once training has settled); PyTorch's default is 1000, ours 10.
        min_compression_rate: compress a matrix only when n*m >= rate * r*(n+m).
        seed: the seed of the initial Q, the same on every rank.
    """

    def __init__(
        self, rank: int = 1, *, start_iter: int = 10, min_compression_rate: float = 2.0, seed: int = 0
    ) -> None:
        if rank < 1:
            raise ValueError(f"powersgd: rank must be at least 1, not {rank}")
        if start_iter < 0 or min_compression_rate <= 0:
            raise ValueError("powersgd: start_iter must be >= 0 and min_compression_rate > 0")
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.seed = seed

    def _matrices(self, bucket: GradBucket) -> list[tuple[int, int, int]]:
        """(view index, n, m) of the views worth compressing."""
        out = []
        for i, shape in enumerate(bucket.shapes):
            if len(shape) < 2:
                continue
            n = shape[0]
            m = 1
            for d in shape[1:]:
                m *= d
            if n * m >= self.min_compression_rate * self.rank * (n + m):
                out.append((i, n, m))
        return out

    def __call__(self, bucket: GradBucket) -> Work:
        st = bucket.state
        steps = st["powersgd.steps"] = st.get("powersgd.steps", -1) + 1
        if steps < self.start_iter:
            return allreduce(bucket)
        ops, group, r = bucket.ops, bucket.group, self.rank
        dtype = str(bucket.buffer.dtype).removeprefix("torch.")
        matrices = self._matrices(bucket)
        if not matrices:
            return allreduce(bucket)
        compressed = {i for i, _, _ in matrices}
        plain = [i for i in range(len(bucket.views)) if i not in compressed]

        fresh = "powersgd.error" not in st
        error = bucket.scratch("powersgd.error", len(bucket.buffer), dtype)
        if fresh or bucket.shadow:  # a rank that joined contributes zeros, its old error included
            ops.zero_(error)
        ops.add_(bucket.buffer, error)  # error feedback: M += what was lost last time

        p_flat = bucket.scratch("powersgd.p", sum(n * r for _, n, _ in matrices), dtype)
        q_flat = bucket.scratch("powersgd.q", sum(m * r for _, _, m in matrices), dtype)
        if "powersgd.q_ready" not in st:
            offset = 0
            for k, (_, _, m) in enumerate(matrices):
                ops.copy(q_flat[offset : offset + m * r], ops.standard_normal(q_flat, (m * r, 1), self.seed + k)[:, 0])
                offset += m * r
            st["powersgd.q_ready"] = True
        ms, ps, qs, errs = [], [], [], []
        p_off = q_off = 0
        error_views = _views_like(bucket, error)
        for i, n, m in matrices:
            ms.append(bucket.views[i].reshape(n, m))
            errs.append(error_views[i].reshape(n, m))
            ps.append(p_flat[p_off : p_off + n * r].reshape(n, r))
            qs.append(q_flat[q_off : q_off + m * r].reshape(m, r))
            p_off += n * r
            q_off += m * r

        plain_work: Work | None = None
        plain_flat = None
        if plain:
            plain_flat = bucket.scratch("powersgd.plain", sum(_numel(bucket.shapes[i]) for i in plain), dtype)
            off = 0
            for i in plain:
                k = _numel(bucket.shapes[i])
                ops.copy(plain_flat[off : off + k], bucket.views[i].reshape(k))
                off += k
            plain_work = group.all_reduce(plain_flat, ReduceOp.AVG, async_op=True)
        for mat, p, q in zip(ms, ps, qs, strict=True):
            ops.matmul(p, mat, q)
        p_work = group.all_reduce(p_flat, ReduceOp.AVG, async_op=True)

        def finish() -> None:
            assert p_work is not None
            p_work.wait()
            for mat, p, q in zip(ms, ps, qs, strict=True):
                ops.orthonormalize(p)
                ops.matmul(q, mat.T, p)
            group.all_reduce(q_flat, ReduceOp.AVG)
            for mat, p, q, err in zip(ms, ps, qs, errs, strict=True):
                ops.copy(err, mat)
                ops.matmul(mat, p, q.T)
                ops.sub(err, err, mat)
            if plain_work is not None and plain_flat is not None:
                plain_work.wait()
                off = 0
                for i in plain:
                    k = _numel(bucket.shapes[i])
                    ops.copy(bucket.views[i].reshape(k), plain_flat[off : off + k])
                    off += k

        return _Then(None, finish)


def powersgd(rank: int = 1, *, start_iter: int = 10, min_compression_rate: float = 2.0, seed: int = 0) -> PowerSGD:
    """A PowerSGD hook of the given rank (see ``PowerSGD``)."""
    return PowerSGD(rank, start_iter=start_iter, min_compression_rate=min_compression_rate, seed=seed)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _views_like(bucket: GradBucket, flat: Any) -> list[Any]:
    out, off = [], 0
    for shape in bucket.shapes:
        k = _numel(shape)
        out.append(flat[off : off + k].reshape(shape))
        off += k
    return out
