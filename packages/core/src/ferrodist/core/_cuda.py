"""The one CUDA module of ferrodist: ``numba.cuda`` and the CUDA driver (cuda-python), both
imported lazily; the simulator check; the one map from CUDA status codes to ferrodist
errors; and the rule that every thread calling CUDA first makes its device's primary
context current (:func:`on_device`).

Everything here works the same on a real GPU and under Numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``), where "device memory" is host memory, device arrays are
``FakeCUDAArray`` wrappers of numpy arrays, and :data:`SIMULATED` stands in for the driver
(it refuses calls from a thread without a current context, as the driver does).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from types import TracebackType
from typing import Any

import numpy as np

from ._cuda_sim import INVALID_CONTEXT, SimulatedDriver
from ._errors import DeviceUnavailable, FerrodistError, InvalidArgument

__all__ = [
    "SIMULATED",
    "array_from_interface",
    "check",
    "cuda",
    "current_device",
    "device_index",
    "device_of",
    "device_pointer",
    "driver",
    "error",
    "is_device_array",
    "has_context",
    "on_device",
    "on_device_of",
    "simulated",
]

_HOW = (
    "install the NVIDIA driver and numba-cuda (pip install -e ./packages/gpu from a clone of ferrodist) on a machine with a CUDA GPU, "
    "or set NUMBA_ENABLE_CUDASIM=1 before the first import of numba.cuda to use Numba's CUDA simulator"
)

#: The driver under Numba's CUDA simulator.
SIMULATED = SimulatedDriver()

_lock = threading.Lock()
_started: set[int] = set()  # id() of drivers cuInit was called on
_numba_started: list[bool] = []  # [True] once numba's driver was initialised (under _lock)
_primary: dict[tuple[int, int], Any] = {}  # (id(driver), device) -> its primary context, retained


# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------


@functools.cache
def _load() -> Any:
    try:
        from numba import cuda as module
    except ImportError as exc:  # pragma: no cover - numba ships numba.cuda, numba-cuda replaces it
        raise DeviceUnavailable(f"numba.cuda cannot be imported ({exc}); {_HOW}") from None
    return module


def simulated() -> bool:
    """True when Numba's CUDA simulator stands in for the GPU."""
    from numba import config

    return bool(config.ENABLE_CUDASIM)  # type: ignore[attr-defined]


@functools.cache
def _real_driver() -> Any:
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        try:
            from cuda import cuda as cu  # type: ignore[attr-defined, no-redef]  # cuda-python before 12.6
        except ImportError:
            raise DeviceUnavailable(
                "ferrodist calls the CUDA driver through cuda-python: pip install cuda-python "
                "(or numba-cuda[cu12] / numba-cuda[cu13])"
            ) from None
    return cu


def driver() -> Any:
    """cuda-python's driver module (``cuda.bindings.driver``), or :data:`SIMULATED` under the
    simulator. Raises ``DeviceUnavailable`` naming what to install when it is missing."""
    return SIMULATED if simulated() else _real_driver()


def cuda(operation: str = "a CUDA tensor") -> Any:
    """``numba.cuda``, with its driver initialised once per process under a lock (Numba's
    own first initialisation is not safe from several threads at once: a thread that asks
    while another initialises goes on with an uninitialised driver). Make a context current
    (:func:`on_device`) before using it in a thread. ``DeviceUnavailable`` says what to
    install when there is no device."""
    module = _load()
    if not _numba_started:
        with _lock:
            if not _numba_started:
                module.is_available()  # cuInit, once, while no other thread can race it
                _numba_started.append(True)
    if not module.is_available():
        raise DeviceUnavailable(f"{operation} needs a CUDA device, and none is usable here; {_HOW}")
    return module


# ---------------------------------------------------------------------------------------
# Status codes
# ---------------------------------------------------------------------------------------

#: Errors that mean "no usable GPU here" rather than a bug in the call: the driver API's
#: names, then the runtime API's (cuda-python's ``cudaError_t``, which NCCL's side uses).
_NO_DEVICE = frozenset(
    {
        "CUDA_ERROR_NO_DEVICE",
        "CUDA_ERROR_INVALID_DEVICE",
        "CUDA_ERROR_DEVICE_UNAVAILABLE",
        "CUDA_ERROR_DEVICE_NOT_LICENSED",
        "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
        "CUDA_ERROR_STUB_LIBRARY",
        "CUDA_ERROR_SYSTEM_NOT_READY",
        "CUDA_ERROR_NOT_SUPPORTED",
        "cudaErrorNoDevice",
        "cudaErrorInsufficientDriver",
        "cudaErrorInvalidDevice",
        "cudaErrorDevicesUnavailable",
        "cudaErrorInitializationError",
        "cudaErrorSystemDriverMismatch",
        "cudaErrorCompatNotSupportedOnDevice",
        "cudaErrorCallRequiresNewerDriver",
        "cudaErrorSystemNotReady",
        "cudaErrorNotSupported",
    }
)
_BAD_ARGUMENT = frozenset(
    {
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_ERROR_INVALID_HANDLE",
        "cudaErrorInvalidValue",
        "cudaErrorInvalidDevicePointer",
        "cudaErrorInvalidResourceHandle",
    }
)


def _text(result: Any) -> str:
    value = result[1] if isinstance(result, tuple) and len(result) > 1 else b""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value or "")


def error(
    err: Any,
    operation: str,
    *,
    rank: int | None = None,
    cu: Any = None,
    runtime: Any = None,
    no_device: str = "",
) -> FerrodistError:
    """The ferrodist error for a failed CUDA call (one map for the whole project): the
    driver API's status (``cu``: the driver module, found when None), or the runtime API's
    (``runtime``: cuda-python's runtime module, which describes it). ``DeviceUnavailable``
    when there is no usable GPU (``no_device`` says what to do instead, where the caller
    knows better), ``InvalidArgument`` for a bad value or handle, else ``FerrodistError``;
    each says what to do."""
    name = getattr(err, "name", None)
    try:
        if runtime is not None:
            text = _text(runtime.cudaGetErrorString(err))
        else:
            cu = driver() if cu is None else cu
            name = name or _text(cu.cuGetErrorName(err))
            text = _text(cu.cuGetErrorString(err))
    except Exception:  # the library itself is unusable: the status's name is all there is
        text = ""
    name = name or f"CUDA error {int(err)}"
    where = f"rank {rank}: " if rank is not None else ""
    message = f"{where}{operation} failed: {name}" + (f" ({text})" if text else "")
    cls: type[FerrodistError] = FerrodistError
    if name in _NO_DEVICE:
        cls = DeviceUnavailable
        message += f"; no usable CUDA GPU here (check nvidia-smi and CUDA_VISIBLE_DEVICES); {no_device or _HOW}"
    elif name in _BAD_ARGUMENT:
        cls = InvalidArgument
    elif name == "CUDA_ERROR_INVALID_CONTEXT" or (runtime is None and int(err) == INVALID_CONTEXT):
        message += (
            "; no CUDA context is current in this thread: ferrodist makes one current before its own calls, "
            "so from your own code call ferrodist.core.cuda.on_device(index) (or torch.cuda.set_device) first"
        )
    else:
        message += "; the GPU or its driver is in trouble (see nvidia-smi)"
    return cls(message, rank=rank, operation=operation)


def check(
    result: Any,
    operation: str,
    *,
    rank: int | None = None,
    cu: Any = None,
    runtime: Any = None,
    no_device: str = "",
) -> Any:
    """Unpack a CUDA result ``(status, *values)``: the value (or values, or None), or
    raise :func:`error`'s exception (``cu``, ``runtime`` and ``no_device`` as there)."""
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if int(err) != 0:
        raise error(err, operation, rank=rank, cu=cu, runtime=runtime, no_device=no_device)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


# ---------------------------------------------------------------------------------------
# Contexts
# ---------------------------------------------------------------------------------------


class _Kept:
    """What :func:`on_device` returns when nothing is to be undone."""

    def __enter__(self) -> _Kept:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _Pushed:
    """Pops the context :func:`on_device` pushed over another device's."""

    def __init__(self, cu: Any) -> None:
        self._cu = cu

    def __enter__(self) -> _Pushed:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        check(self._cu.cuCtxPopCurrent(), "cuCtxPopCurrent", cu=self._cu)


_KEPT = _Kept()


def _start(cu: Any) -> None:
    if id(cu) not in _started:
        with _lock:
            if id(cu) not in _started:
                check(cu.cuInit(0), "cuInit", cu=cu)
                _started.add(id(cu))


def _primary_context(cu: Any, index: int) -> Any:
    key = (id(cu), index)
    context = _primary.get(key)
    if context is None:
        with _lock:
            context = _primary.get(key)
            if context is None:
                device = check(cu.cuDeviceGet(index), f"cuDeviceGet({index})", cu=cu)
                context = check(cu.cuDevicePrimaryCtxRetain(device), f"cuDevicePrimaryCtxRetain({index})", cu=cu)
                _primary[key] = context  # retained for the life of the process
    return context


def on_device(index: int | None = None, *, cu: Any = None) -> _Kept | _Pushed:
    """Make device ``index``'s primary context current in the calling thread.

    Every thread that calls CUDA does this first: the ranks of ``run_world``, a group's
    async worker, DDP hooks in an autograd thread, a user's own threads. In a thread with
    no current context, the context stays current afterwards; where it already is
    current, nothing happens; over another device's context it is pushed, and popped when
    the returned object is used as a context manager and exits (use ``with``).
    ``index=None`` keeps whatever context is current, else takes device 0's.

    Example::

        with on_device(tensor.device.index):
            ...  # driver calls and kernel launches on that device
    """
    cu = driver() if cu is None else cu
    _start(cu)
    current = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent", cu=cu)
    current = int(current or 0)
    if index is None:
        if current:
            return _KEPT
        index = 0
    wanted = _primary_context(cu, index)
    if current == int(wanted):
        return _KEPT
    if not current:
        check(cu.cuCtxSetCurrent(wanted), "cuCtxSetCurrent", cu=cu)
        return _KEPT
    check(cu.cuCtxPushCurrent(wanted), "cuCtxPushCurrent", cu=cu)
    return _Pushed(cu)


def has_context(cu: Any = None) -> bool:
    """True when the calling thread has a current context."""
    cu = driver() if cu is None else cu
    _start(cu)
    return bool(int(check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent", cu=cu) or 0))


def on_device_of(array: Any) -> _Kept | _Pushed:
    """:func:`on_device` for the device ``array`` is on, in a thread without a current
    context; else the current context is kept (the caller chose it, as for any launch)."""
    if has_context():
        return _KEPT
    return on_device(device_of(array))


def current_device() -> int:
    """The ordinal of the device whose context is current in this thread (0 when none is,
    and under the simulator)."""
    if simulated():
        return 0
    cu = driver()
    _start(cu)
    if not int(check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent", cu=cu) or 0):
        return 0
    return int(check(cu.cuCtxGetDevice(), "cuCtxGetDevice", cu=cu))


def device_index() -> int:
    """The current CUDA device's ordinal (0 under the simulator)."""
    cuda()
    return current_device()


def _pointer_device(pointer: int) -> int | None:
    """The device ordinal of a device pointer, or None (a null pointer, or memory the
    driver does not describe: then the current context is kept)."""
    if not pointer:
        return None
    cu = driver()
    _start(cu)
    attribute = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    try:
        return int(check(cu.cuPointerGetAttribute(attribute, pointer), "cuPointerGetAttribute", cu=cu))
    except FerrodistError:
        return None


def device_of(array: Any) -> int:
    """The ordinal of the device a device array's memory is on (the current device for an
    empty array, and 0 under the simulator)."""
    if simulated() or not array.size:
        return current_device()
    found = _pointer_device(device_pointer(array))
    return current_device() if found is None else found


# ---------------------------------------------------------------------------------------
# Device arrays
# ---------------------------------------------------------------------------------------


def is_device_array(obj: object) -> bool:
    """True for a Numba device array (or the simulator's stand-in), without importing numba.cuda."""
    module = type(obj).__module__
    return module.startswith(("numba.cuda.", "numba_cuda.")) and hasattr(obj, "copy_to_host")


def device_pointer(array: Any) -> int:
    """The address of a device array's first byte (a host address under the simulator)."""
    if simulated():
        return int(array._ary.ctypes.data)
    return int(array.__cuda_array_interface__["data"][0])


def array_from_interface(obj: Any, interface: dict[str, Any], device: int | None = None) -> Any:
    """A device array over the memory that ``interface`` (a ``__cuda_array_interface__``
    dict) describes, without copying; ``obj`` is kept alive by the result. ``device`` is the
    memory's device when the caller knows it (else the driver is asked)."""
    module = cuda("as_tensor of a CUDA array")
    shape = tuple(int(n) for n in interface["shape"])
    dt = np.dtype(interface["typestr"])
    if interface.get("mask") is not None:
        raise InvalidArgument("as_tensor: masked CUDA arrays are not supported; fill the masked values first")
    strides = interface.get("strides")
    if strides is not None and not _is_contiguous(shape, tuple(strides), dt.itemsize):
        raise InvalidArgument(
            f"as_tensor: the CUDA array of shape {shape} with strides {tuple(strides)} is not C-contiguous; "
            "ferrodist works in place and will not copy: pass a contiguous array (x.contiguous() / cupy.ascontiguousarray)"
        )
    pointer = int(interface["data"][0])
    if pointer == 0 and 0 not in shape:
        raise InvalidArgument(f"as_tensor: the CUDA array of shape {shape} has a null data pointer")
    if not simulated():
        with on_device(device if device is not None else _pointer_device(pointer)):
            return module.as_cuda_array(obj)
    # Simulator: the "device" pointer is a host address; view it and wrap it like to_device does.
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        host = np.empty(shape, dt)
    else:
        raw = (ctypes.c_byte * (count * dt.itemsize)).from_address(pointer)
        host = np.frombuffer(raw, dtype=dt).reshape(shape)
    array = FakeCUDAArray(host)
    array._ferrodist_owner = obj  # type: ignore[attr-defined]  # the producer's memory lives as long as this view
    return array


def _is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """C-contiguity as numpy judges it: strides of dimensions of length 1 do not matter."""
    if 0 in shape:
        return True
    step = itemsize
    for n, stride in zip(reversed(shape), reversed(strides), strict=True):
        if n != 1 and stride != step:
            return False
        step *= n
    return True
