"""The engine that executes a bucket plan, one backward at a time.

Per synchronised step: gradients live in the buckets' flat buffers (views, so a sync
copies nothing), each parameter's hook marks it final, a bucket whose parameters are all
final is handed to the communication hook, buckets start strictly in plan order (so every
rank issues the same collectives in the same order, whatever order its gradients come in),
and the end of backward starts whatever is left and waits for all of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ferrodist.collectives import ProcessGroup, reads_in_place, tracing
from ferrodist.core import Group, InvalidArgument, ReduceOp, Work, dtype

from ._buckets import BucketPlan
from ._hooks import GradBucket
from ._models import Model
from ._overlap import OverlapChoice

__all__ = ["Reducer"]


Hook = Callable[[GradBucket], Work]


class Reducer:
    def __init__(
        self, model: Model, group: Group, plan: BucketPlan, hook: Hook, *, overlap: bool | str, find_unused: bool
    ) -> None:
        self.model = model
        self.group = group
        self.plan = plan
        self.hook = hook
        if overlap not in (True, False, "auto"):
            raise InvalidArgument(f"DistributedDataParallel: overlap must be True, False or 'auto', not {overlap!r}")
        self.choice = OverlapChoice() if overlap == "auto" else None
        self.overlap = overlap is not False
        self.find_unused = find_unused
        n = len(model.params)
        # A host bucket of a ProcessGroup lives in the memory its ranks share where its
        # all_reduce would then read every rank's bucket in place (the group shares memory,
        # and the bucket's size is in the range where that is faster) and where its
        # gradients are copied into it anyway. A shared bucket is never swapped for a
        # gradient of its own (every rank must pass it): a bucket of one PyTorch parameter,
        # which averages autograd's fresh tensor where it is, stays an ordinary array (the
        # copy into a shared bucket would cost more than reading in place saves).
        self.shared = [
            b.device == "cpu"
            and not (len(b.params) == 1 and model.fresh_gradients)
            and isinstance(group, ProcessGroup)
            and reads_in_place(b.numel * dtype(b.dtype).itemsize, group)
            for b in plan.buckets
        ]
        self.flats = [
            model.shared_flat(b.dtype, b.numel, group)
            if self.shared[b.index]
            else model.flat(b.dtype, b.device, b.numel)
            for b in plan.buckets
        ]
        self.views: list[Any] = [None] * n  # each gradient's place: its bucket view, or its own adopted array
        self.homes: list[Any] = [None] * n  # each gradient's view into its bucket's flat buffer
        self.bucket_of = [0] * n
        self.buckets: list[GradBucket] = []
        for b in plan.buckets:
            views = []
            for p, off, numel, shape in zip(b.params, b.offsets, b.numels, b.shapes, strict=True):
                view = model.view(self.flats[b.index], off, numel, shape)
                self.views[p] = self.homes[p] = view
                self.bucket_of[p] = b.index
                views.append(view)
            self.buckets.append(
                GradBucket(
                    index=b.index,
                    buffer=self.flats[b.index],
                    views=tuple(views),
                    names=b.names,
                    shapes=b.shapes,
                    group=group,
                    ops=model,
                    is_last=b.index == len(plan.buckets) - 1,
                )
            )
        self.ops = model
        self.handles = [model.hook(i, self._ready) for i in range(n)]
        self.used = np.zeros(n, dtype=np.uint8)  # gradients seen since the last sync (no_sync steps included)
        self.syncing = False  # a backward averages only when a DDP forward started its step
        self.scale = 1.0  # join(): size / active ranks when averaging over the ranks still training
        self.on_step: Callable[[float, list[float], float], None] | None = None
        self._reset()

    # -- one backward ------------------------------------------------------------------
    def _reset(self) -> None:
        nb = len(self.plan.buckets)
        self.marked = [False] * len(self.views)
        self.pending = [len(b.params) for b in self.plan.buckets]
        self.next = 0
        self.works: list[Work | None] = [None] * nb
        self.ready_at = [float("nan")] * nb
        self.queued = False
        self.started = time.perf_counter()
        self.traced = tracing.enabled()  # FERRODIST_TRACE: each bucket on the rank's timeline
        self.launched = [0] * nb
        self.step_start = tracing.now() if self.traced else 0

    def prepare(self, *, syncing: bool) -> None:
        """Start a step (called from the forward): every gradient becomes its bucket view."""
        if any(w is not None for w in self.works):
            raise InvalidArgument(
                f"rank {self.group.rank}: DistributedDataParallel: a forward started while the previous backward's "
                "gradients were still being averaged; finish backward first"
            )
        self._reset()
        self.syncing = syncing
        if syncing and self.choice is not None:
            self.overlap = self.choice.next()
        model = self.model
        # PyTorch's autograd hands a missing gradient its freshly computed tensor, so one copy
        # into the bucket (in _ready) is cheaper than a zeroed view plus an in-place addition
        # (one pass over the gradients against three). The kit copies either way.
        steal = model.fresh_gradients
        for i, view in enumerate(self.views):
            grad = model.grad(i)
            if grad is not None and model.is_view(grad, view):
                continue  # the gradient is where its bucket expects it (adopted ones too)
            if view is not self.homes[i]:
                self._home(i)  # the adopted array is the user's now: back to the bucket's view
            if grad is None:
                if not steal:
                    model.zero_(self.homes[i])
                    model.set_grad(i, self.homes[i])
            else:
                model.copy(self.homes[i], grad)
                model.set_grad(i, self.homes[i])

    def _ready(self, i: int) -> None:
        model = self.model
        grad = model.grad(i)
        if grad is not None and not model.is_view(grad, self.views[i]):
            # The gradient arrived in an array of its own (the step was not prepared, or the
            # optimizer set it to None). A bucket of this one parameter averages it where it
            # is (no copy: PyTorch's large weights); else one copy into the bucket, and the
            # bucket's view from now on.
            b = self.bucket_of[i]
            alone = len(self.plan.buckets[b].params) == 1 and not self.shared[b]
            flat = model.adoptable(grad, self.homes[i]) if alone else None
            if flat is not None:
                self.views[i] = grad
                self.buckets[b].buffer, self.buckets[b].views = flat, (grad,)
            else:
                if self.views[i] is not self.homes[i]:
                    self._home(i)
                model.copy(self.homes[i], grad)
                model.set_grad(i, self.homes[i])
        self.used[i] = 1
        if model.autograd and not self.queued:
            self.queued = True
            model.at_end_of_backward(self.finish)
        if not self.syncing:
            return
        if self.marked[i]:
            if self.overlap:
                raise InvalidArgument(
                    f"rank {self.group.rank}: DistributedDataParallel: parameter {model.names[i]!r} received a gradient "
                    "twice in one backward (it is used twice); its bucket was already being averaged. Pass overlap=False"
                )
            return
        self.marked[i] = True
        b = self.bucket_of[i]
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self.ready_at[b] = time.perf_counter() - self.started
            if self.overlap:
                self._launch_ready()

    def _home(self, i: int) -> None:
        """Parameter i's gradient lives in its bucket's flat buffer again (only the gradient
        of a bucket of one parameter is ever adopted)."""
        b = self.bucket_of[i]
        self.views[i] = self.homes[i]
        self.buckets[b].buffer, self.buckets[b].views = self.flats[b], (self.homes[i],)

    def _launch_ready(self) -> None:
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            self._launch(self.next)

    def _launch(self, b: int) -> None:
        if self.traced:
            self.launched[b] = tracing.now()
        self.works[b] = self.hook(self.buckets[b])
        self.next = b + 1

    def finish(self) -> None:
        """End of backward: start what is left, wait for every bucket, settle unused parameters."""
        self.queued = False
        syncing, self.syncing = self.syncing, False  # the next backward needs a forward (or sync_all)
        if not syncing:
            self.marked = [False] * len(self.views)
            return
        backward_end = time.perf_counter() - self.started
        model = self.model
        for i in (i for i, marked in enumerate(self.marked) if not marked):
            # No gradient this step; its bucket, not started yet (it waits for every
            # parameter), carries what no_sync steps kept, else zeros.
            grad, view = model.grad(i), self.views[i]
            if grad is None:
                model.zero_(view)
                model.set_grad(i, view)
            elif not model.is_view(grad, view):
                model.copy(view, grad)
                model.set_grad(i, view)
        while self.next < len(self.buckets):
            self._launch(self.next)
        usage: Any = None
        usage_work = None
        if self.find_unused:
            usage = self.model.small(self.used.astype(np.int32))
            usage_work = self.group.all_reduce(usage, ReduceOp.SUM, async_op=True)
        waited = time.perf_counter()
        waited_at = tracing.now() if self.traced else 0
        try:
            for b, work in enumerate(self.works):
                assert work is not None
                work.wait()
                if self.traced:
                    self._trace_bucket(b)
            if usage_work is not None:
                usage_work.wait()
        finally:
            self.works = [None] * len(self.buckets)
        wait = time.perf_counter() - waited
        if self.traced:
            tracing.span(self.group, "backward", "ddp", "DDP step", self.step_start, waited_at)
            tracing.span(self.group, "wait for buckets", "ddp", "DDP step", waited_at)
        if self.scale != 1.0:
            for bucket in self.buckets:
                self.ops.scale_(bucket.buffer, self.scale)
        missing = [i for i, m in enumerate(self.marked) if not m]
        self.used[:] = 0
        if self.find_unused:
            counts = self.model.numpy(usage)
            for i in missing:
                if counts[i] == 0:  # no rank produced a gradient: as in one process, it has none
                    self.model.set_grad(i, None)
        elif missing:
            names = ", ".join(repr(self.model.names[i]) for i in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise InvalidArgument(
                f"rank {self.group.rank}: DistributedDataParallel: parameters {names}{more} got no gradient in this "
                "backward (their buckets were averaged with zeros on this rank). If that is expected, pass "
                "find_unused_parameters=True; otherwise check that the forward uses them"
            )
        if self.choice is not None:
            self.choice.record(self.overlap, time.perf_counter() - self.started)
        if self.on_step is not None:
            ready = [t if t == t else backward_end for t in self.ready_at]
            self.on_step(max(ready) if ready else backward_end, ready, wait)

    def _trace_bucket(self, b: int) -> None:
        """Bucket ``b`` on the rank's timeline: from the hook's start to the end of its wait."""
        bucket = self.plan.buckets[b]
        nbytes = bucket.numel * dtype(bucket.dtype).itemsize
        tracing.span(
            self.group,
            f"bucket {b}",
            "ddp",
            "DDP buckets",
            self.launched[b],
            parameters=len(bucket.params),
            bytes=nbytes,
            ready_ms=round(1e3 * self.ready_at[b], 3) if self.ready_at[b] == self.ready_at[b] else None,
        )

    def sync_all(self) -> None:
        """Average what backwards run outside a DDP forward accumulated (a pipeline step):
        the parameters that got gradients count as final, the others as unused."""
        self.prepare(syncing=True)
        for i, used in enumerate(self.used):
            if used:
                self.marked[i] = True
                self.pending[self.bucket_of[i]] -= 1
        self.finish()

    # -- a rank that ran out of inputs inside join() -------------------------------------
    def shadow(self) -> None:
        """Take part in one synchronised step with zero gradients (the others' step)."""
        for i, view in enumerate(self.views):
            if view is not self.homes[i]:
                self._home(i)
        for b in self.buckets:
            b.shadow = True
        try:
            for flat in self.flats:
                self.ops.zero_(flat)
            works = [self.hook(b) for b in self.buckets]
            usage_work = None
            if self.find_unused:
                usage_work = self.group.all_reduce(
                    self.model.small(np.zeros(len(self.views), np.int32)), ReduceOp.SUM, async_op=True
                )
            for work in works:
                work.wait()
            if usage_work is not None:
                usage_work.wait()
        finally:
            for b in self.buckets:
                b.shadow = False

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
