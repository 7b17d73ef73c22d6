"""``Pipeline``: runs one rank's actions of a schedule, moving activations and gradients.

Chunk ``c`` of rank ``r`` is model stage ``s = c * p + r``. F of stage s receives its
input from stage s - 1 (the batch's rows on stage 0), runs the chunk, and sends its output
to stage s + 1 (the last stage computes the loss instead). B receives the gradient of the
output from stage s + 1 (the last stage starts from its loss), computes the gradient of
the input and sends it to stage s - 1. W accumulates the weight gradients; BW does both.
The sends and receives are steps of the rank's list, made explicit by lowering the
schedule (``_lower``), the same steps ``validate`` and ``simulate`` run. Sends never wait
for their receiver; receives are posted a few actions ahead, into buffers
the receiving chunk makes (numpy arrays, or tensors on its GPU: device arrays travel through
the group's device engine). A failure on one rank aborts the group, so every other rank
raises at once instead of at its deadline.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ferrodist.collectives import default_group, tracing
from ferrodist.core import CollectiveMismatch, DType, Group, InvalidArgument, Work, as_tensor

from ._actions import Action, Schedule
from ._check import validate
from ._lower import RECV, SEND, Step, lower_actions
from ._stages import Stage, adapt_stage
from ._wire import HEADER_WORDS, Pool, check_sizes, header, read_header, split_rows, tag

__all__ = ["Pipeline"]

LOOKAHEAD = 4  # actions whose receives are posted before they run


class Pipeline:
    """Pipeline-parallel training of one model cut into stages, one (or, interleaved,
    ``schedule.chunks``) per rank of ``group``.

    Args:
        stage: this rank's chunk: a ``ferrodist.nn`` Module, a torch ``nn.Module`` (on the
            CPU or a CUDA device: its inputs and gradients are received there) or a
            ``Stage``; for a schedule with v chunks per rank, a list of v of them (chunk c is
            model stage ``c * group.size + group.rank``).
        group: the ranks of the pipeline, in stage order (None: the default group).
        n_microbatches: micro-batches per step.
        schedule: ``GPipe()``, ``OneFOneB()``, ``Interleaved1F1B(v)``, ``ZeroBubbleH1()`` or
            a ``CustomSchedule``; checked with ``validate`` here.

    Example (4 ranks, each holding a quarter of the model)::

        stages = split_sequential(model, 4)
        pipe = Pipeline(stages[rank], None, 8, OneFOneB())
        loss = pipe.train_step(x if rank == 0 else None, y if rank == 3 else None, CrossEntropyLoss())
        opt.step()   # each rank's optimizer over its stage's parameters
    """

    def __init__(self, stage: Any, group: Group | None, n_microbatches: int, schedule: Schedule) -> None:
        self.group = default_group() if group is None else group
        if not isinstance(schedule, Schedule):
            raise InvalidArgument(f"Pipeline: schedule must be a Schedule (OneFOneB(), ...), not {schedule!r}")
        modules = list(stage) if isinstance(stage, (list, tuple)) else [stage]
        if len(modules) != schedule.chunks:
            raise InvalidArgument(
                f"Pipeline: {schedule!r} runs {schedule.chunks} chunk(s) per rank, but rank {self.group.rank} "
                f"was given {len(modules)}"
            )
        self.stages: list[Stage] = [adapt_stage(m) for m in modules]
        self.modules = modules
        self.schedule = schedule
        self.n_microbatches = n_microbatches
        p = self.group.size
        validate(schedule, p, n_microbatches)
        check_sizes(p * schedule.chunks, n_microbatches)
        self.actions = schedule.actions(self.group.rank, p, n_microbatches)
        self.lowered = lower_actions(self.actions, self.group.rank, p, schedule.chunks)
        self.steps = 0
        self._pool = Pool()

    # -- the public steps --------------------------------------------------------------
    def train_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Any,
        *,
        reduction: str | None = None,
        broadcast_loss: bool = False,
    ) -> float | None:
        """One step: the batch cut into micro-batches, the schedule run, every stage's
        parameter gradients accumulated as the unsplit model's on the whole batch.

        Args:
            inputs: the batch (first stage; other ranks may pass None).
            targets: its targets (last stage; other ranks may pass None).
            loss_fn: ``loss_fn(output, target)``: a ``ferrodist.nn`` loss (with ``backward()``)
                or a torch loss.
            reduction: "mean" (each micro-batch's loss weighted by its share of the rows)
                or "sum" (weight 1); default: ``loss_fn.reduction`` if it has one, else "mean".
            broadcast_loss: give every stage the loss (otherwise only the last stage has it).

        Returns:
            The batch's loss on the last stage (on every stage with ``broadcast_loss``), else None.
        """
        if reduction is None:
            reduction = getattr(loss_fn, "reduction", "mean")
        if reduction not in ("mean", "sum"):
            raise InvalidArgument(f"Pipeline.train_step: reduction must be 'mean' or 'sum', not {reduction!r}")
        loss = self._run(self.lowered, inputs, targets, loss_fn, reduction, training=True)
        if broadcast_loss:
            value = np.array([loss if loss is not None else 0.0])
            self.group.broadcast(value, self.group.size - 1)
            loss = float(value[0])
        return loss

    def eval_step(self, inputs: Any) -> Any:
        """Forward only, micro-batch by micro-batch; returns the outputs of the whole batch
        on the last stage (a numpy array, or a tensor for torch stages), None elsewhere."""
        forwards = [Action("F", i, c) for i in range(self.n_microbatches) for c in range(self.schedule.chunks)]
        steps = lower_actions(forwards, self.group.rank, self.group.size, self.schedule.chunks)
        return self._run(steps, inputs, None, None, "mean", training=False)

    # -- the engine ----------------------------------------------------------------------
    def _run(
        self, steps: list[Step], inputs: Any, targets: Any, loss_fn: Any, reduction: str, *, training: bool
    ) -> Any:
        self.steps += 1
        run = _Step(self, steps, inputs, targets, loss_fn, reduction, training)
        try:
            return run.go()
        except BaseException as exc:
            for stage in self.stages:
                stage.clear()
            run.cancel()
            if self.group.size > 1:
                self.group.abort(exc)
            raise


class _Step:
    """One train or eval step on this rank."""

    def __init__(
        self,
        pipe: Pipeline,
        steps: list[Step],
        inputs: Any,
        targets: Any,
        loss_fn: Any,
        reduction: str,
        training: bool,
    ) -> None:
        self.pipe = pipe
        self.steps = steps
        self.loss_fn = loss_fn
        self.reduction = reduction
        self.training = training
        g = pipe.group
        self.p, self.me, self.v = g.size, g.rank, pipe.schedule.chunks
        self.last = self.p * self.v - 1
        self.m = pipe.n_microbatches
        self.who = f"rank {g.global_rank}: Pipeline.{'train' if training else 'eval'}_step #{pipe.steps}"
        self.inputs, self.targets = inputs, targets
        self.batch: dict[int, int] = {}  # stage -> batch size (from the data or the header)
        self._bounds: dict[int, list[tuple[int, int]]] = {}  # batch size -> micro-batch row ranges
        self.shapes: dict[int, tuple[DType, tuple[int, ...]]] = {}  # boundary -> activation's (dtype, trailing)
        self.sent_headers: set[int] = set()
        # (kind, stage, mb) -> (its receive, the buffer, its dtype; no receive or dtype: a local message)
        self.posted: dict[tuple[str, int, int], tuple[Work | None, Any, Any]] = {}
        self.held: dict[tuple[int, int], list[tuple[Any, DType]]] = {}  # (stage, mb) -> pool buffers until W
        self.local: dict[int, Any] = {}  # messages to this rank itself (p == 1)
        self.inbox: dict[tuple[str, int, int], Any] = {}  # received, for the compute step after
        self.outbox: dict[tuple[str, int, int], tuple[Any, Stage]] = {}  # computed, for the send step after
        self.sends: list[Work] = []
        self.outputs: dict[int, Any] = {}
        self.loss = 0.0
        self.headers: dict[int, tuple[Work, np.ndarray[Any, Any]]] = {}
        if 0 in self._my_stages():
            if inputs is None:
                raise InvalidArgument(f"{self.who}: the first stage needs the inputs")
            self.batch[0] = len(inputs)
            self._rows(0, 0)  # a batch too small for the micro-batches is refused before any message
        if training and self.last in self._my_stages() and targets is None:
            raise InvalidArgument(f"{self.who}: the last stage needs the targets")
        for s in self._my_stages():
            if s > 0 and self._rank_of(s - 1) != self.me:  # post the headers' receives now
                buf = np.zeros(HEADER_WORDS, np.int64)
                self.headers[s - 1] = (self.pipe.group.irecv(buf, self._rank_of(s - 1), tag(s - 1, False, -1)), buf)

    def _rows(self, s: int, i: int) -> tuple[int, int]:
        """Micro-batch ``i``'s rows of stage ``s``'s batch (worked out once per batch size)."""
        batch = self.batch[s]
        bounds = self._bounds.get(batch)
        if bounds is None:
            bounds = self._bounds[batch] = split_rows(batch, self.m, self.who)
        return bounds[i]

    def _my_stages(self) -> list[int]:
        return [c * self.p + self.me for c in range(self.v)]

    def _rank_of(self, stage: int) -> int:
        return stage % self.p

    # -- the loop -----------------------------------------------------------------------
    def go(self) -> Any:
        traced = tracing.enabled()  # FERRODIST_TRACE: each action on the rank's timeline
        for k, step in enumerate(self.steps):
            self._post_ahead(k)
            if step.kind == RECV:
                kind = "B" if step.gradient else "F"
                self.inbox[(kind, step.stage, step.action.microbatch)] = self._receive(
                    kind, step.stage, step.action.microbatch
                )
                continue
            if step.kind == SEND:
                self._deliver(step)
                continue
            start = tracing.now() if traced else 0
            self._act(step.action, step.stage)
            if traced:
                tracing.span(
                    self.pipe.group,
                    str(step.action),
                    "pipeline",
                    "pipeline actions",
                    start,
                    step=self.pipe.steps,
                    stage=step.stage,
                )
        for work in self.sends:
            work.wait()
        if not self.training:
            if self.last not in self._my_stages():
                return None
            return self.pipe.stages[-1].concat([self.outputs[i] for i in range(self.m)])
        return self.loss if self.last in self._my_stages() else None

    def _act(self, a: Action, s: int) -> None:
        """Run compute action ``a`` of stage ``s`` (its receive done, its send left to the next step)."""
        stage = self.pipe.stages[a.chunk]
        i = a.microbatch
        if a.kind == "F":
            self._forward(a, s, stage)
        elif a.kind == "W":
            stage.backward_weight(i)
            self._release(s, i)
        else:
            grad = None if s == self.last else self.inbox.pop(("B", s, i))
            fused = a.kind == "BW"
            gx = stage.backward(i, grad) if fused else stage.backward_input(i, grad)
            if s > 0:
                self._check_grad(s, i, gx)
                self.outbox[("B", s, i)] = (gx, stage)
            if fused:
                self._release(s, i)

    def _deliver(self, step: Step) -> None:
        """Send what the compute step before made: stage s's output to s + 1, or the gradient
        of its input to s - 1."""
        s, i = step.stage, step.action.microbatch
        if step.gradient:
            gx, stage = self.outbox.pop(("B", s, i))
            dtype, _ = self.shapes[s - 1]
            self._send(s - 1, tag(s - 1, True, i), stage.outgoing(gx, dtype), stage)
        else:
            out, stage = self.outbox.pop(("F", s, i))
            self._send(s + 1, tag(s, False, i), out, stage)

    def cancel(self) -> None:
        self.posted.clear()
        self.held.clear()

    # -- forward ------------------------------------------------------------------------
    def _forward(self, a: Action, s: int, stage: Stage) -> None:
        i = a.microbatch
        if s == 0:
            lo, hi = self._rows(0, i)
            x = self.inputs[lo:hi]
        else:
            x = self.inbox.pop(("F", s, i))
        y = stage.forward(i, x, keep=self.training)
        if s == self.last:
            if not self.training:
                self.outputs[i] = y
                return
            batch = self.batch[s]
            if len(self.targets) != batch:
                raise InvalidArgument(
                    f"{self.who}: the targets have {len(self.targets)} rows but the batch has {batch}; pass the "
                    "targets of the same batch"
                )
            lo, hi = self._rows(s, i)
            weight = (hi - lo) / batch if self.reduction == "mean" else 1.0
            self.loss += stage.loss(i, y, self.targets[lo:hi], self.loss_fn, weight)
            return
        out = stage.outgoing(y)
        t = as_tensor(out)
        batch = self.batch[s]
        lo, hi = self._rows(s, i)
        if s not in self.sent_headers:
            self.sent_headers.add(s)
            words = header(self.pipe.steps, self.training, batch, t, self.who)
            self.shapes[s] = (t.dtype, t.shape[1:])
            self._send(s + 1, tag(s, False, -1), words, None)
        dtype, trailing = self.shapes[s]
        if t.shape != (hi - lo, *trailing) or t.dtype != dtype:
            raise CollectiveMismatch(
                f"{self.who}: stage {s}'s output for micro-batch {i} has shape {t.shape} and dtype {t.dtype.name}, "
                f"but this step's first one announced {(hi - lo, *trailing)} and {dtype.name}: every micro-batch's "
                "output must have the same shape past the batch dimension"
            )
        self.outbox[("F", s, i)] = (out, stage)

    # -- backward -----------------------------------------------------------------------
    def _check_grad(self, s: int, i: int, gx: Any) -> None:
        if gx is None:
            raise InvalidArgument(f"{self.who}: stage {s} produced no gradient for its input (micro-batch {i})")
        _, trailing = self.shapes[s - 1]
        lo, hi = self._rows(s, i)
        if tuple(gx.shape) != (hi - lo, *trailing):
            raise InvalidArgument(
                f"{self.who}: stage {s}'s gradient for its input (micro-batch {i}) has shape {tuple(gx.shape)}, but "
                f"the input had shape {(hi - lo, *trailing)}"
            )

    # -- messages -----------------------------------------------------------------------
    def _send(self, stage: int, wire_tag: int, data: Any, sender: Stage | None) -> None:
        """Send ``data`` (contiguous) to the rank of ``stage``; ``sender``: the chunk that made it
        (None: a header)."""
        dst = self._rank_of(stage)
        if dst == self.me:
            self.local[wire_tag] = data.copy() if sender is None else sender.copy(data)
            return
        self.sends.append(self.pipe.group.isend(data, dst, wire_tag))

    def _boundary_shape(self, boundary: int) -> tuple[DType, tuple[int, ...]] | None:
        """The activation shape on ``boundary`` this step (receiving: from the header)."""
        if boundary + 1 in self.batch:  # the header of this boundary was read
            return self.shapes[boundary]
        if self._rank_of(boundary) == self.me:  # sent by this rank (p == 1)
            words = self.local.pop(tag(boundary, False, -1), None)
            if words is None:
                return None
        else:
            work, words = self.headers[boundary]
            work.wait()
        batch, dtype, trailing = read_header(words, self.pipe.steps, self.training, self.who)
        stage = boundary + 1
        expected = self.pipe.stages[stage // self.p].expected_features()
        if expected is not None and (not trailing or trailing[-1] != expected):
            raise CollectiveMismatch(
                f"{self.who}: stage {stage} takes inputs of {expected} features, but stage {boundary} (rank "
                f"{self._rank_of(boundary)}) sends activations of shape (batch, {', '.join(map(str, trailing))}): "
                "the stages do not fit together; check where the model was cut"
            )
        if self.last == stage and self.training and self.targets is not None and len(self.targets) != batch:
            raise InvalidArgument(
                f"{self.who}: the targets have {len(self.targets)} rows but the first stage's batch has {batch}"
            )
        self.batch[stage] = batch
        self.shapes[boundary] = (dtype, trailing)
        return dtype, trailing

    def _receive(self, kind: str, s: int, i: int) -> Any:
        key = (kind, s, i)
        if key not in self.posted and not self._post(kind, s, i):
            raise AssertionError(f"{self.who}: {key} could not be posted")  # validate() rules this out
        work, buf, dtype = self.posted.pop(key)
        if work is not None:  # a receive into a pool buffer (not a local message)
            work.wait()
            self.held.setdefault((s, i), []).append((buf, dtype))
        return buf

    def _post(self, kind: str, s: int, i: int) -> bool:
        """Post the receive of F's input or B's output gradient; False if its shape is not known yet."""
        boundary = s - 1 if kind == "F" else s
        if kind == "F" and self._boundary_shape(boundary) is None:
            return False
        if kind == "B" and boundary not in self.shapes:
            return False  # this rank's F of stage s has not run: its output shape is unknown
        dtype, trailing = self.shapes[boundary]
        lo, hi = self._rows(s, i)
        wire_tag = tag(boundary, kind == "B", i)
        peer = self._rank_of(boundary if kind == "F" else s + 1)
        if peer == self.me:
            if wire_tag not in self.local:
                return False
            self.posted[(kind, s, i)] = (None, self.local.pop(wire_tag), None)
            return True
        chunk = s // self.p
        buf = self.pipe._pool.take(chunk, (hi - lo, *trailing), dtype, self.pipe.stages[chunk].empty)
        self.posted[(kind, s, i)] = (self.pipe.group.irecv(buf, peer, wire_tag), buf, dtype)
        return True

    def _post_ahead(self, k: int) -> None:
        """Post the receives among the next few actions' steps whose shapes are known."""
        first = self.steps[k].index
        for step in self.steps[k:]:
            if step.index >= first + LOOKAHEAD:
                break
            if step.kind != RECV or step.peer == self.me:
                continue
            s, i = step.stage, step.action.microbatch
            if step.gradient:
                if ("B", s, i) not in self.posted and s in self.shapes:
                    self._post("B", s, i)
            elif ("F", s, i) not in self.posted and (s in self.batch or self._header_arrived(s - 1)):
                self._post("F", s, i)

    def _header_arrived(self, boundary: int) -> bool:
        work, _ = self.headers[boundary]
        if not work.is_completed():
            return False
        self._boundary_shape(boundary)
        return True

    def _release(self, s: int, i: int) -> None:
        for buf, dtype in self.held.pop((s, i), []):
            self.pipe._pool.give(s // self.p, buf, dtype)
