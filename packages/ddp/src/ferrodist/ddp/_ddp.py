"""``DistributedDataParallel``: one model, N processes, the gradients of the whole batch."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ferrodist.collectives import default_group
from ferrodist.core import CollectiveMismatch, Group, InvalidArgument, InvalidRank, ReduceOp

from ._buckets import DEFAULT_FIRST_BUCKET_MB, BucketPlan, plan_buckets
from ._hooks import GradBucket, allreduce
from ._models import adapt
from ._reducer import Hook, Reducer
from ._stats import StepStats, StragglerReport, summarize

__all__ = ["DDP", "DistributedDataParallel"]


class DistributedDataParallel:
    """Train one model on every rank of ``group`` as if on the whole batch.

    Each rank runs forward and backward on its own shard of the batch; DDP averages the
    gradients over the group, bucket by bucket, while backward is still running. After
    ``backward`` every rank holds the same gradients (the whole batch's, for a loss that
    averages over the batch) and the optimizers keep the replicas identical.

    Args:
        module: a ``ferrodist.nn`` Module or a PyTorch ``nn.Module`` (CPU or CUDA).
        group: the group to average over (default: the default process group); a
            ``ProcessGroup`` on any backend, or a device group such as ``NcclGroup``.
        bucket_cap_mb: close a bucket once it holds this many MiB of gradients.
        first_bucket_cap_mb: the first bucket's cap (small, so communication starts early).
        broadcast_from: the rank whose parameters and buffers every replica starts from.
        comm_hook: how a bucket is averaged (default ``allreduce``; ``fp16_compress``,
            ``bf16_compress``, ``powersgd(rank=r)`` or your own ``hook(bucket) -> Work``).
        find_unused_parameters: allow parameters that get no gradient on some ranks in a
            step; the ranks agree which got none anywhere (those keep no gradient).
        overlap: ``True`` starts each bucket's average as soon as its gradients are final;
            ``False`` starts them all after backward; ``"auto"`` (default) times a few steps
            each way and keeps the faster (overlapping hides the communication only where
            a core is free for it).
        report_every: every this many synchronised steps, exchange the timings and have
            rank 0 call ``report`` with a one-line straggler summary.
        report: where the summary goes (default ``print``).

    Example (``ferrodist.nn``)::

        model = DDP(nn.Sequential(nn.Linear(8, 16, rng=0), nn.ReLU(), nn.Linear(16, 1, rng=1)))
        opt = nn.SGD(model.parameters(), lr=0.1)
        loss_fn = nn.MSELoss()
        loss = loss_fn(model(x_shard), y_shard)   # each rank its own shard
        model.backward(loss_fn.backward())        # gradients averaged over the ranks
        opt.step()                                # every rank: the same parameters
    """

    def __init__(
        self,
        module: Any,
        group: Group | None = None,
        *,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = DEFAULT_FIRST_BUCKET_MB,
        broadcast_from: int = 0,
        comm_hook: Hook | None = None,
        find_unused_parameters: bool = False,
        overlap: bool | str = "auto",
        report_every: int | None = None,
        report: Callable[[str], None] = print,
        history: int = 10_000,
    ) -> None:
        self.group: Group = group if group is not None else default_group()
        self.module = module
        self._model = adapt(module)
        if not 0 <= broadcast_from < self.group.size:
            raise InvalidRank(
                f"rank {self.group.rank}: DistributedDataParallel: broadcast_from={broadcast_from} is outside 0..{self.group.size - 1}"
            )
        if report_every is not None and report_every < 1:
            raise InvalidArgument(
                f"DistributedDataParallel: report_every must be a positive number of steps, not {report_every}"
            )
        self._check_replicas()
        for _, array in self._model.state():
            self.group.broadcast(array, broadcast_from)
        self._plan = plan_buckets(self._model.specs(), cap_mb=bucket_cap_mb, first_cap_mb=first_bucket_cap_mb)
        self._reducer = Reducer(
            self._model,
            self.group,
            self._plan,
            comm_hook or allreduce,
            overlap=overlap,
            find_unused=find_unused_parameters,
        )
        self._reducer.on_step = self._record
        self._sync = True
        self._joined: dict[str, Any] | None = None
        self._report_every = report_every
        self._report = report
        self._history = history
        self._rows: list[list[float]] = []  # this rank's timings since the last exchange
        self._stats: list[StepStats] = []
        self._steps = 0  # synchronised steps (shadowed ones included)

    # -- what it wraps ---------------------------------------------------------------------
    @property
    def bucket_plan(self) -> BucketPlan:
        """Which parameter's gradient lives where (a plain value; ``.describe()`` prints it)."""
        return self._plan

    @property
    def buckets(self) -> list[GradBucket]:
        return self._reducer.buckets

    def parameters(self) -> Any:
        return self.module.parameters()

    def named_parameters(self) -> Any:
        return self.module.named_parameters()

    def state_dict(self) -> Any:
        return self.module.state_dict()

    def load_state_dict(self, state: Any) -> Any:
        return self.module.load_state_dict(state)

    def train(self, mode: bool = True) -> DistributedDataParallel:
        self.module.train(mode)
        return self

    def eval(self) -> DistributedDataParallel:
        self.module.eval()
        return self

    def register_comm_hook(self, hook: Hook) -> None:
        """Average buckets with ``hook`` from the next step on (every rank must do the same)."""
        self._reducer.hook = hook

    # -- a step ----------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Start a step on this rank's shard: the module's forward, gradients set up as bucket views."""
        syncing = self._sync
        if self._joined is not None:
            syncing = self._announce(syncing)
        self._reducer.prepare(syncing=syncing)
        return self.module(*args, **kwargs)

    def backward(self, grad_output: Any) -> Any:
        """``ferrodist.nn`` modules: backward through the module, averaging gradients as they
        become final; returns the gradient with respect to the input. (PyTorch modules:
        call ``loss.backward()``, which DDP hooks into.)"""
        if self._model.autograd:
            raise InvalidArgument(
                "DistributedDataParallel.backward is for ferrodist.nn modules; call loss.backward() on a torch loss"
            )
        grad_input = self.module.backward(grad_output)
        self._reducer.finish()
        return grad_input

    def sync_gradients(self) -> None:
        """Average across the replicas the gradients that backward passes run on the wrapped
        module itself (not through this wrapper's forward) accumulated since the last
        average: a pipeline step (``ferrodist.pipeline``), a custom loop. Every replica calls
        it once per step, after its backward passes; parameters that got no gradient are
        handled as in a step (an error, or with ``find_unused_parameters=True`` agreed)."""
        self._reducer.sync_all()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward inside this block averages nothing; the
        first backward after it averages everything accumulated (a bigger batch)."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    # -- uneven inputs ---------------------------------------------------------------------
    @contextmanager
    def join(self, *, divide_by_initial_world_size: bool = True) -> Iterator[None]:
        """Train over uneven inputs: a rank that runs out of batches leaves the loop and
        keeps answering the others' gradient averages with zeros until every rank is done;
        then all ranks take the model of the rank that trained longest.

        ``divide_by_initial_world_size``: average over all ranks (PyTorch's default) or, with
        ``False``, over the ranks still training, which equals one process training on the
        union of the remaining ranks' batches.
        """
        if self._joined is not None:
            raise InvalidArgument("DistributedDataParallel.join() is already active")
        self._joined = {"steps": 0, "divide_by_initial": divide_by_initial_world_size}
        try:
            yield
        except BaseException:
            self._reducer.scale = 1.0
            self._joined = None
            raise
        try:
            while True:
                counts = self._model.small(np.zeros(2, dtype=np.int64))
                self.group.all_reduce(counts, ReduceOp.SUM)
                active, syncing = (int(v) for v in self._model.numpy(counts))
                if active == 0:
                    break
                self._check_agreement(active, syncing)
                if syncing:
                    self._reducer.shadow()
                    self._record(float("nan"), [float("nan")] * len(self._plan.buckets), float("nan"))
            self._take_longest_model()
        finally:
            self._reducer.scale = 1.0
            self._joined = None

    def _announce(self, syncing: bool) -> bool:
        """Inside join(): tell the others this rank is still training, and whether it syncs."""
        assert self._joined is not None
        self._joined["steps"] += 1
        counts = self._model.small(np.array([1, int(syncing)], dtype=np.int64))
        self.group.all_reduce(counts, ReduceOp.SUM)
        active, agreeing = (int(v) for v in self._model.numpy(counts))
        self._check_agreement(active, agreeing)
        if not self._joined["divide_by_initial"]:
            self._reducer.scale = self.group.size / active
        return syncing

    def _check_agreement(self, active: int, syncing: int) -> None:
        if 0 < syncing < active:
            raise CollectiveMismatch(
                f"rank {self.group.rank}: DistributedDataParallel.join: {syncing} of the {active} training ranks "
                "average gradients in this step and the rest are inside no_sync(); every rank must do the same"
            )

    def _take_longest_model(self) -> None:
        assert self._joined is not None
        steps = np.zeros(self.group.size, dtype=np.int64)
        steps[self.group.rank] = self._joined["steps"]
        steps_t = self._model.small(steps)
        self.group.all_reduce(steps_t, ReduceOp.SUM)
        per_rank = self._model.numpy(steps_t)
        if (per_rank == per_rank[0]).all():
            return
        longest = int(np.argmax(per_rank))
        for _, array in self._model.state():
            self.group.broadcast(array, longest)

    # -- the straggler report ----------------------------------------------------------------
    def _record(self, compute: float, ready: list[float], wait: float) -> None:
        self._rows.append([compute, wait, *ready])
        self._steps += 1
        if self._report_every is not None and self._steps % self._report_every == 0:
            report = self.stats()
            if self.group.rank == 0:
                self._report(report.summary(last=self._report_every))

    def stats(self) -> StragglerReport:
        """Exchange the step timings recorded since the last exchange and return every
        step's report. A collective: call it on every rank, at the same step."""
        buckets = len(self._plan.buckets)
        mine = np.array(self._rows, dtype=np.float64).reshape(len(self._rows), 2 + buckets)
        counts_np = np.zeros(self.group.size, dtype=np.int64)
        counts_np[self.group.rank] = len(self._rows)
        counts = self._model.small(counts_np)
        self.group.all_reduce(counts, ReduceOp.SUM)
        per_rank = self._model.numpy(counts)
        if not (per_rank == per_rank[0]).all():
            raise CollectiveMismatch(
                f"rank {self.group.rank}: DistributedDataParallel.stats: ranks have recorded different numbers of "
                f"synchronised steps ({per_rank.tolist()}); call stats() at the same step on every rank"
            )
        if len(self._rows):
            out = self._model.small(np.zeros(self.group.size * mine.size, dtype=np.float64))
            self.group.all_gather(out, self._model.small(np.ascontiguousarray(mine).reshape(-1)))
            rows = self._model.numpy(out).reshape(self.group.size, len(self._rows), 2 + buckets)
            first = self._steps - len(self._rows) + 1
            self._stats += summarize(first, rows, buckets)
            self._stats = self._stats[-self._history :]
            self._rows = []
        return StragglerReport(steps=tuple(self._stats), size=self.group.size)

    # -- at construction ---------------------------------------------------------------------
    def _check_replicas(self) -> None:
        """Every rank must wrap the same parameters: same names, shapes and dtypes."""
        mine = [(name, list(a.shape), str(a.dtype)) for name, a in self._model.state()]
        blob = np.frombuffer(json.dumps(mine).encode(), dtype=np.uint8)
        lengths_np = np.zeros(self.group.size, dtype=np.int64)
        lengths_np[self.group.rank] = blob.size
        lengths = self._model.small(lengths_np)
        self.group.all_reduce(lengths, ReduceOp.SUM)
        per_rank = self._model.numpy(lengths)
        longest = int(per_rank.max())
        padded = np.zeros(longest, dtype=np.uint8)
        padded[: blob.size] = blob
        out = self._model.small(np.zeros(self.group.size * longest, dtype=np.uint8))
        self.group.all_gather(out, self._model.small(padded))
        gathered = self._model.numpy(out).reshape(self.group.size, longest)
        described = [json.loads(gathered[r, : per_rank[r]].tobytes().decode()) for r in range(self.group.size)]
        if all(d == described[0] for d in described):
            return
        count = max(len(d) for d in described)
        for k in range(count):
            entries = [d[k] if k < len(d) else None for d in described]
            if any(e != entries[0] for e in entries):
                seen = "; ".join(
                    f"rank {r}: " + (f"{e[0]!r} {tuple(e[1])} {e[2]}" if e else "nothing")
                    for r, e in enumerate(entries)
                )
                raise CollectiveMismatch(
                    f"rank {self.group.rank}: DistributedDataParallel: the replicas differ at parameter/buffer #{k}: "
                    f"{seen}. Build the same model on every rank"
                )


DDP = DistributedDataParallel
