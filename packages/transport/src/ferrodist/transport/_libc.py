"""libc's system calls, called by symbol from compiled code (no ctypes pointer is baked
in, so the code that uses them goes to Numba's cache like any kernel): ``sys_recv`` and
``sys_sendmsg`` for tcp's small frames (``_tcp.compiled``), ``sys_yield`` for the waits that
give their core away (``_shm.spin``, ``_tcp.compiled``), and ``address``, where an array's
data starts."""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["address", "sys_recv", "sys_sendmsg", "sys_yield"]


def _symbol(name: str, ret: ir.Type, *params: ir.Type) -> Any:
    def call(builder: Any, *args: Any) -> Any:
        fnty = ir.FunctionType(ret, list(params))
        return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), list(args))

    return call


_I32, _I64 = ir.IntType(32), ir.IntType(64)
_PTR = ir.IntType(8).as_pointer()
_recv = _symbol("recv", _I64, _I32, _PTR, _I64, _I32)
_sendmsg = _symbol("sendmsg", _I64, _I32, _PTR, _I32)
_errno_location = _symbol("__errno_location", _I32.as_pointer())
_sched_yield = _symbol("sched_yield", _I32)


def _sys_recv(typingctx: Any, fd: Any, address: Any, count: Any, flags: Any) -> Any:
    """``recv(fd, address, count, flags)``: bytes read, 0 at the end of the stream, or -errno."""
    sig = types.int64(types.int64, types.int64, types.int64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fd, address, count, flags = args
        got = _recv(
            builder, builder.trunc(fd, _I32), builder.inttoptr(address, _PTR), count, builder.trunc(flags, _I32)
        )
        return _or_errno(builder, got)

    return sig, codegen


def _sys_sendmsg(typingctx: Any, fd: Any, message: Any, flags: Any) -> Any:
    """``sendmsg(fd, message, flags)``: bytes sent, or -errno."""
    sig = types.int64(types.int64, types.int64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fd, message, flags = args
        sent = _sendmsg(builder, builder.trunc(fd, _I32), builder.inttoptr(message, _PTR), builder.trunc(flags, _I32))
        return _or_errno(builder, sent)

    return sig, codegen


def _sys_yield(typingctx: Any) -> Any:
    """``sched_yield()``: give the core to another runnable thread."""
    sig = types.int64()

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.sext(_sched_yield(builder), _I64)

    return sig, codegen


def _or_errno(builder: Any, result: Any) -> Any:
    """``result`` of a call that returns -1 and sets errno: the result, or -errno."""
    code = builder.sext(builder.load(_errno_location(builder)), _I64)
    return builder.select(builder.icmp_signed("<", result, ir.Constant(_I64, 0)), builder.neg(code), result)


def _address(typingctx: Any, array: Any) -> Any:
    """Where ``array``'s data starts, as an int64."""
    if not isinstance(array, types.Array):
        return None
    sig = types.int64(array)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, _I64)

    return sig, codegen


# Typed as Any: mypy would read an intrinsic's typing context as an argument of its calls.
sys_recv: Any = intrinsic(_sys_recv)
sys_sendmsg: Any = intrinsic(_sys_sendmsg)
sys_yield: Any = intrinsic(_sys_yield)
address: Any = intrinsic(_address)
