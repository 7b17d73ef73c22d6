"""The one route of a group's calls: check, then plan, then run.

*Check* (``Checker``) validates a call's arguments on this rank. *Plan* is decided here and
nowhere else: a frozen :class:`Plan` says where the call runs (the group's device engine,
the transport's own collective, or one of our algorithms), with its kernel, divisor and
fingerprint, and holds the body that does it. Plans are kept per call signature, so a
call of a kind seen before skips the checks and the decision: the group looks its plan
up from the arguments as given (:meth:`Route.known`). *Run* is the group's ``Runner``:
ordering, call identity, deadline, abort and blame.

The CPU half of the route (:meth:`Route.cpu`) serves both the group's host arrays and
the device engines that stage CUDA tensors through host memory (``BoundHost``), so a
staged segment takes exactly the route a numpy array of its size would.

``FERRODIST_DEBUG=route`` prints every plan once, when it is made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

from ferrodist.core import DeviceEngine, DType, GroupInfo, ReduceOp, reducer, uint8
from ferrodist.core.kernels import through_bfloat16
from ferrodist.transport import NativeCollectives

from ._algorithms import direct, doubling, ring, tree
from ._algorithms import native as native_calls
from ._algorithms.select import all_reduce_algorithm
from ._call import Array, Call
from ._checks import Blocks
from ._debug import debugging_routes
from ._device import RECORD_BYTES, DeviceRoute
from ._fingerprint import COUNT_MASK, fingerprint
from ._levels.run import Levels
from ._levels.steps import OPERATIONS as LEVEL_OPERATIONS
from ._plan import Body, Plan
from ._runner import Runner

__all__ = ["BoundHost", "Plan", "Route"]

#: The most plans a group keeps; past it the table starts again (a program whose shapes
#: never repeat must not grow it without bound).
_MAX_PLANS = 1024


class Route:
    """The route of one group's calls on this rank: its plans, its CPU route (the
    transport's own collectives where they apply, else ours) and its device engine."""

    def __init__(
        self, runner: Runner, native: NativeCollectives | None, devices: DeviceRoute, info: GroupInfo, *, debug: bool
    ) -> None:
        self.runner = runner
        self.native = native  # the transport's own collectives for this group, or None
        self.levels: Levels | None = None  # a world spanning nodes: its two levels
        self.devices = devices
        self.info = info  # name, this rank, size, timeout
        self.keep = not debug  # debug mode compares every call across ranks: nothing is skipped
        self.show = debugging_routes()
        self._plans: dict[Hashable, Plan] = {}
        self._known: dict[Hashable, Plan] = {}
        self._bodies: dict[Hashable, tuple[str, Body]] = {}

    # -- plans ------------------------------------------------------------------------------------
    def use_levels(self, levels: Levels) -> None:
        """Run the group's collectives over ``levels`` from the next call on: the plans made
        for the flat group before are dropped."""
        self.levels = levels
        for table in (self._plans, self._known, self._bodies):
            table.clear()

    def known(self, signature: Hashable) -> Plan | None:
        """The plan of a call whose arguments, as given, match a call checked before."""
        try:
            return self._known.get(signature)
        except TypeError:  # an argument that cannot be hashed (a list as op): the checks will say
            return None

    def plan(
        self,
        operation: str,
        dt: DType | None,
        count: int,
        *,
        op: ReduceOp | None = None,
        root: int | None = None,
        algorithm: str | None = None,
        engine: DeviceEngine | None = None,
        wire: DType | None = None,
        signature: Hashable = None,
    ) -> Plan:
        """The plan of a checked call (made once per kind); kept under ``signature`` too
        (the arguments as given) when the caller passes one."""
        key = (operation, dt, count, op, root, algorithm, engine, wire)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._make(operation, dt, count, op, root, algorithm, engine, wire)
            if len(self._plans) >= _MAX_PLANS:
                self._known.clear()  # its plans are the table's
            _keep(self._plans, key, plan)
            if self.show:
                print(f"[ferrodist] rank {self.runner.transport.rank}: group {self.info.name}: {plan}", flush=True)
        if signature is not None and self.keep:
            try:
                self._known[signature] = plan
            except TypeError:
                pass
        return plan

    def _make(
        self,
        operation: str,
        dt: DType | None,
        count: int,
        op: ReduceOp | None,
        root: int | None,
        algorithm: str | None,
        engine: DeviceEngine | None,
        wire: DType | None,
    ) -> Plan:
        size = self.info.size
        direct = engine is not None and engine.direct
        if operation == "all_reduce":
            fp = fingerprint(operation, wire or dt, count, op, direct=direct)
        elif operation in ("all_gather", "broadcast", "gather", "scatter", "barrier"):
            fp = fingerprint(operation, dt, count, root=root, direct=direct)
        elif operation == "all_to_all":  # block sizes may differ per pair: not in the fingerprint
            fp = fingerprint(operation, dt, direct=direct)
        else:
            fp = fingerprint(operation, dt, count, op, root, direct=direct)
        if engine is not None:
            route, body = engine.name, _device_body(self, engine, operation, op, root, wire)
        elif wire is not None and wire is not dt:
            assert op is not None
            route, body = self.compressed(wire, count, op, algorithm)
        else:
            assert dt is not None or operation == "barrier"
            route, body = self.cpu(operation, dt, count, op, root, algorithm)
        scale = op.divisor(size) if op is not None else 1.0
        native_call = None
        if route == "transport" and operation == "all_reduce" and self.native is not None and wire in (None, dt):
            assert dt is not None and op is not None
            native_call = self.native.bound_all_reduce(dt, op, count)
        return Plan(operation, route, dt, count, op, root, scale, fp, body, native_call)

    # -- the CPU route ----------------------------------------------------------------------------
    def cpu(
        self,
        operation: str,
        dt: DType | None,
        count: int,
        op: ReduceOp | None = None,
        root: int | None = None,
        algorithm: str | None = None,
    ) -> tuple[str, Body]:
        """Where a call on host arrays runs, and its body: the transport's own collective
        when it can do this call (dtype, op; all_reduce up to its size limit) and the caller
        named none of our algorithms, else ours; in a world that spans nodes, the two levels
        (``_levels.run``) for the collectives they run."""
        key = (operation, dt, count, op, root, algorithm)
        found = self._bodies.get(key)
        if found is None:
            levels = self.levels
            if levels is not None and algorithm in (None, "auto") and operation in LEVEL_OPERATIONS:
                found = ("levels", levels.body(operation, dt, op, root))
            else:
                found = _cpu_body(self.native, self.info, operation, dt, count, op, root, algorithm)
            _keep(self._bodies, key, found)
        return found

    def compressed(self, wire: DType, count: int, op: ReduceOp, algorithm: str | None) -> tuple[str, Body]:
        """A float32 all_reduce on the host sent as ``wire`` (bfloat16): the route of that
        all_reduce of ``wire``, run on the rounded array and widened back, or the transport's
        own collective, which rounds and widens inside its loop."""
        route, body = self.cpu("all_reduce", wire, count, op, None, algorithm)
        native = self.native
        if route == "transport" and native is not None:
            return route, lambda call, x: native.all_reduce_compressed(
                x, wire, op, call.deadline, call.fingerprint, call.seq
            )
        return route, lambda call, x: through_bfloat16(x, lambda bits: body(call, bits))

    # -- the device engine ------------------------------------------------------------------------
    def engine(self, dt: DType, op: ReduceOp | None) -> DeviceEngine:
        """The engine for a call on CUDA tensors: the group's (chosen in a setup call of its
        own, ``cuda_route``, the first time), or the staged one where it cannot do the call."""
        devices = self.devices
        engine = devices.engine
        if engine is None:
            with devices.lock:
                if devices.engine is None:
                    info = self.info
                    self.runner.launch(
                        "cuda_route",
                        lambda call: devices.setup(call, info),
                        fingerprint("cuda_route", uint8, RECORD_BYTES),
                        async_op=False,
                        timeout=None,
                    )
                engine = devices.engine
                assert engine is not None  # setup raised otherwise
        return devices.for_call(engine, dt, op)

    def close(self) -> None:
        native, self.native = self.native, None
        levels, self.levels = self.levels, None
        if levels is not None:
            levels.close()
        self._plans.clear()
        self._known.clear()
        self._bodies.clear()
        if native is not None:
            native.free()
        self.devices.close()


def _keep(table: dict[Hashable, Any], key: Hashable, value: Any) -> None:
    """Put ``value`` in ``table``, which starts again once it holds ``_MAX_PLANS``."""
    if len(table) >= _MAX_PLANS:
        table.clear()
    table[key] = value


def _takes(native: NativeCollectives | None, dt: DType | None, op: ReduceOp | None, nbytes: int) -> bool:
    """Whether the transport's own collectives can run this call."""
    if native is None or dt is None or not native.supports(dt, op):
        return False
    return nbytes <= native.all_reduce_up_to


def _cpu_body(
    native: NativeCollectives | None,
    info: GroupInfo,
    operation: str,
    dt: DType | None,
    count: int,
    op: ReduceOp | None,
    root: int | None,
    algorithm: str | None,
) -> tuple[str, Body]:
    """The CPU route of one kind of call: ``(route name, body(call, *arrays))``."""
    size, rank = info.size, info.rank
    nbytes = count * dt.itemsize if dt is not None and operation == "all_reduce" else 0
    own = algorithm in (None, "auto") and _takes(native, dt, op, nbytes)
    at = -1 if root is None else root  # the root of a rooted collective
    kernel: Any = reducer(dt, op) if op is not None and dt is not None else None
    scale = op.divisor(size) if op is not None else 1.0
    if own and operation in _NATIVE and not (operation == "reduce_scatter" and size == 1):
        assert native is not None and dt is not None
        return "transport", _native_body(native, operation, dt, op, at)
    if operation == "all_reduce":
        name = all_reduce_algorithm(nbytes, size, algorithm, rank=rank)
        run = ring.all_reduce if name == "ring" else doubling.all_reduce
        return name, lambda call, x: run(call, x, kernel, scale)
    if operation == "broadcast":
        return "tree", lambda call, x: tree.broadcast(call, x, at)
    if operation == "reduce":
        return "tree", lambda call, x: tree.reduce(call, x, at, kernel, scale)
    if operation == "all_gather":
        return "ring", _ring_all_gather
    if operation == "reduce_scatter":
        if size == 1:
            return "copy", _copy_first
        return "ring", lambda call, out, blocks: ring.reduce_scatter(call, out, blocks, kernel, scale)
    if operation == "gather":
        return "direct", lambda call, x, blocks: direct.gather(call, x, blocks, at)
    if operation == "scatter":
        return "direct", lambda call, x, blocks: direct.scatter(call, x, blocks, at)
    if operation == "all_to_all":  # no transport has its own all_to_all
        return "direct", direct.all_to_all
    if operation == "barrier":
        if native is not None:
            return "transport", lambda call: native.barrier(call.deadline, call.fingerprint, call.seq)
        return "dissemination", tree.barrier
    raise AssertionError(f"no CPU route for {operation}")


#: The calls a transport's own collectives take (with a dtype; the barrier has its own line).
_NATIVE = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "gather", "scatter")


def _native_body(native: NativeCollectives, operation: str, dt: DType, op: ReduceOp | None, at: int) -> Body:
    """The body of a call that the transport's own collectives run (``_takes`` said they can)."""
    if operation in ("all_reduce", "reduce", "reduce_scatter"):
        assert op is not None
        reduce_op = op
    if operation == "all_reduce":
        return lambda call, x: native.all_reduce(x, dt, reduce_op, call.deadline, call.fingerprint, call.seq)
    if operation == "broadcast":
        return lambda call, x: native.broadcast(x, at, dt, call.deadline, call.fingerprint, call.seq)
    if operation == "reduce":
        return lambda call, x: native.reduce(x, at, dt, reduce_op, call.deadline, call.fingerprint, call.seq)
    if operation == "all_gather":
        return lambda call, x, blocks: native_calls.all_gather(native, call, x, blocks, dt)
    if operation == "reduce_scatter":
        return lambda call, out, blocks: native_calls.reduce_scatter(native, call, out, blocks, dt, reduce_op)
    if operation == "gather":
        return lambda call, x, blocks: native_calls.gather(native, call, x, blocks, at, dt)
    if operation == "scatter":
        return lambda call, x, blocks: native_calls.scatter(native, call, x, blocks, at, dt)
    raise AssertionError(f"the transport's own collectives do not run {operation}")


def _ring_all_gather(call: Call, x: Array, blocks: Blocks) -> None:
    blocks[call.rank][...] = x
    ring.all_gather(call, blocks)


def _copy_first(call: Call, out: Array, blocks: Blocks) -> None:
    out[...] = blocks[0]


def _device_body(
    route: Route, engine: DeviceEngine, operation: str, op: ReduceOp | None, root: int | None, wire: DType | None
) -> Body:
    """The body of a call on CUDA tensors: the engine's method, handed the CPU route bound
    to the call where it stages through host memory."""
    if operation == "all_reduce":
        assert op is not None and wire is not None
        return lambda call, x: engine.all_reduce(call, BoundHost(route, call), x, op, wire)
    if operation == "broadcast":
        assert root is not None
        return lambda call, x: engine.broadcast(call, BoundHost(route, call), x, root)
    if operation == "reduce":
        assert root is not None and op is not None
        return lambda call, x: engine.reduce(call, BoundHost(route, call), x, root, op)
    if operation == "all_gather":
        return lambda call, x, blocks: engine.all_gather(call, BoundHost(route, call), x, blocks)
    if operation == "reduce_scatter":
        assert op is not None
        return lambda call, out, blocks: engine.reduce_scatter(call, BoundHost(route, call), out, blocks, op)
    if operation == "gather":
        assert root is not None
        return lambda call, x, blocks: engine.gather(call, x, blocks, root)
    if operation == "scatter":
        assert root is not None
        return lambda call, x, blocks: engine.scatter(call, x, blocks, root)
    if operation == "all_to_all":
        return engine.all_to_all
    raise AssertionError(f"no device route for {operation}")


class BoundHost:
    """The group's CPU route bound to one running call: the ``HostRoute`` a device engine
    is handed (``ferrodist.core.HostRoute``). Every method takes flat host arrays of
    one *part* (a segment of the device tensor): the part runs inside the call with the
    call's fingerprint carrying the part's element count, so ranks that cut a tensor into
    different segments raise ``CollectiveMismatch`` instead of combining unrelated bytes."""

    __slots__ = ("_call", "_route")

    def __init__(self, route: Route, call: Call) -> None:
        self._route, self._call = route, call

    def _part(self, count: int) -> Call:
        call = self._call
        fp = (call.fingerprint & ~COUNT_MASK) | (count & COUNT_MASK)
        return call if fp == call.fingerprint else dataclasses.replace(call, fingerprint=fp)

    def all_reduce(self, x: Array, dt: DType, op: ReduceOp) -> None:
        call = self._part(x.shape[0])
        if call.size > 1:
            self._route.cpu("all_reduce", dt, x.shape[0], op)[1](call, x)

    def broadcast(self, x: Array, root: int, dt: DType) -> None:
        self._route.cpu("broadcast", dt, x.shape[0], root=root)[1](self._part(x.shape[0]), x)

    def reduce(self, x: Array, root: int, dt: DType, op: ReduceOp) -> None:
        self._route.cpu("reduce", dt, x.shape[0], op, root)[1](self._part(x.shape[0]), x)

    def all_gather(self, x: Array, out: Array, dt: DType) -> None:
        call = self._part(x.shape[0])
        self._route.cpu("all_gather", dt, x.shape[0])[1](call, x, Blocks.of(out, call.size))

    def reduce_scatter(self, out: Array, inp: Array, dt: DType, op: ReduceOp) -> None:
        call = self._part(out.shape[0])
        self._route.cpu("reduce_scatter", dt, out.shape[0], op)[1](call, out, Blocks.of(inp, call.size))
