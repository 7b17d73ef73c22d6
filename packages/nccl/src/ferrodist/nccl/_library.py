"""Finding and loading ``libnccl.so.2``, and the ctypes declarations of the NCCL C API we call.

Everything here is transcribed from ``nccl.h`` of NCCL 2.18 to 2.32, with the release that added
each newer piece (:data:`ADDED_IN`, :data:`CONFIG_FIELDS`), so one set of bindings serves every
release the extras allow. ``tests/nccl/test_header.py`` parses the header shipped beside the
loaded library, whatever its version, and checks each declaration against it.
Nothing is loaded at import: :func:`load_library` opens the library on first use.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import functools
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ferrodist.core import BackendUnavailable

__all__ = [
    "ADDED_IN",
    "API_MAGIC",
    "CONFIG_FIELDS",
    "CONFIG_LAYOUT_VERSION",
    "CONFIG_UNDEF_INT",
    "ENV_VAR",
    "OPTIONAL",
    "PROTOTYPES",
    "UNIQUE_ID_BYTES",
    "ConfigStruct",
    "DataType",
    "NcclLibrary",
    "RedOp",
    "Result",
    "UniqueIdStruct",
    "config_fields",
    "config_size",
    "find_library_path",
    "is_available",
    "library_path",
    "load_library",
    "nccl_version",
    "version_code",
]

ENV_VAR = "FERRODIST_NCCL_LIB"
UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
API_MAGIC = 0xCAFEBEEF  # NCCL_API_MAGIC
CONFIG_UNDEF_INT = -(2**31)  # NCCL_CONFIG_UNDEF_INT (INT_MIN)
#: The newest NCCL release whose ``ncclConfig_t`` layout :class:`ConfigStruct` transcribes.
CONFIG_LAYOUT_VERSION = (2, 32, 3)

_INSTALL_HINT = (
    "install the NCCL wheel that matches your CUDA (pip install nvidia-nccl-cu12, or nvidia-nccl-cu13), "
    f"or set {ENV_VAR}=/path/to/libnccl.so.2"
)


class Result(enum.IntEnum):
    """``ncclResult_t``."""

    ncclSuccess = 0
    ncclUnhandledCudaError = 1
    ncclSystemError = 2
    ncclInternalError = 3
    ncclInvalidArgument = 4
    ncclInvalidUsage = 5
    ncclRemoteError = 6
    ncclInProgress = 7
    ncclTimeout = 8


class DataType(enum.IntEnum):
    """``ncclDataType_t`` (the primary names; ``ncclChar``/``ncclHalf``/... are aliases)."""

    ncclInt8 = 0
    ncclUint8 = 1
    ncclInt32 = 2
    ncclUint32 = 3
    ncclInt64 = 4
    ncclUint64 = 5
    ncclFloat16 = 6
    ncclFloat32 = 7
    ncclFloat64 = 8
    ncclBfloat16 = 9
    ncclFloat8e4m3 = 10
    ncclFloat8e5m2 = 11


class RedOp(enum.IntEnum):
    """``ncclRedOp_t`` (the built-in operations)."""

    ncclSum = 0
    ncclProd = 1
    ncclMax = 2
    ncclMin = 3
    ncclAvg = 4


def version_code(major: int, minor: int, patch: int) -> int:
    """``NCCL_VERSION(X, Y, Z)``: the integer NCCL uses for a release (2.32.3 -> 23203)."""
    if major <= 2 and minor <= 8:
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch


class UniqueIdStruct(ctypes.Structure):
    """``ncclUniqueId``: ``struct { char internal[NCCL_UNIQUE_ID_BYTES]; }``, passed by value."""

    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


#: ``ncclConfig_t`` field by field in the header's order, with the release that added each.
#: NCCL only ever appends fields, so an older release's struct is a prefix of this one; its
#: ``size`` member tells the library how much of it the caller filled in.
CONFIG_FIELDS: tuple[tuple[str, Any, tuple[int, int, int]], ...] = (
    ("size", ctypes.c_size_t, (2, 14, 0)),
    ("magic", ctypes.c_uint, (2, 14, 0)),
    ("version", ctypes.c_uint, (2, 14, 0)),
    ("blocking", ctypes.c_int, (2, 14, 0)),
    ("cgaClusterSize", ctypes.c_int, (2, 17, 0)),
    ("minCTAs", ctypes.c_int, (2, 17, 0)),
    ("maxCTAs", ctypes.c_int, (2, 17, 0)),
    ("netName", ctypes.c_char_p, (2, 17, 0)),
    ("splitShare", ctypes.c_int, (2, 18, 0)),
    ("trafficClass", ctypes.c_int, (2, 26, 0)),
    ("commName", ctypes.c_char_p, (2, 27, 0)),
    ("collnetEnable", ctypes.c_int, (2, 27, 0)),
    ("CTAPolicy", ctypes.c_int, (2, 27, 0)),
    ("shrinkShare", ctypes.c_int, (2, 27, 0)),
    ("nvlsCTAs", ctypes.c_int, (2, 27, 0)),
    ("nChannelsPerNetPeer", ctypes.c_int, (2, 28, 0)),
    ("nvlinkCentricSched", ctypes.c_int, (2, 28, 0)),
    ("graphUsageMode", ctypes.c_int, (2, 29, 0)),
    ("numRmaCtx", ctypes.c_int, (2, 29, 0)),
    ("maxP2pPeers", ctypes.c_int, (2, 30, 0)),
    ("graphStreamOrdering", ctypes.c_int, (2, 30, 5)),
    ("launchOrderImplicit", ctypes.c_int, (2, 31, 0)),
    ("numRmaSig", ctypes.c_int, (2, 31, 0)),
    ("rmaEagerInit", ctypes.c_int, (2, 31, 0)),
    ("hostCftMode", ctypes.c_int, (2, 31, 0)),
    ("nvlsHostMode", ctypes.c_int, (2, 32, 0)),
)


def config_fields(version: tuple[int, int, int]) -> tuple[str, ...]:
    """The ``ncclConfig_t`` fields the release ``version`` has, in order."""
    return tuple(name for name, _, since in CONFIG_FIELDS if since <= tuple(version))


def config_size(version: tuple[int, int, int]) -> int:
    """``sizeof(ncclConfig_t)`` in the release ``version``: its fields plus C's tail padding."""
    last = config_fields(version)[-1]
    end = getattr(ConfigStruct, last).offset + getattr(ConfigStruct, last).size
    align = ctypes.alignment(ConfigStruct)
    return -(-end // align) * align


class ConfigStruct(ctypes.Structure):
    """``ncclConfig_t`` in the newest layout. Build it with :meth:`initialized`.

    A struct built for an older release sets ``size`` and ``version`` to that release's, so
    the library reads only the fields it knows; the tail stays zero and unread.
    """

    _fields_ = [(name, ctype) for name, ctype, _ in CONFIG_FIELDS]

    @classmethod
    def initialized(cls, version: tuple[int, int, int] = CONFIG_LAYOUT_VERSION) -> ConfigStruct:
        """``NCCL_CONFIG_INITIALIZER`` of release ``version``: every field it has unset."""
        config = cls()
        config.size = config_size(version)
        config.magic = API_MAGIC
        config.version = version_code(*version)
        for name, ctype, since in CONFIG_FIELDS[3:]:
            if ctype is ctypes.c_int and since <= tuple(version):
                setattr(config, name, CONFIG_UNDEF_INT)
        return config


_RESULT = ctypes.c_int  # ncclResult_t, an enum: int-sized
_P = ctypes.c_void_p  # const void*, void*, ncclComm_t, cudaStream_t
_COLL = (_P, _P, ctypes.c_size_t, ctypes.c_int)  # sendbuff, recvbuff, count, datatype

#: name -> (restype, argtypes) of every function we call, as declared in nccl.h.
PROTOTYPES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "ncclGetVersion": (_RESULT, (ctypes.POINTER(ctypes.c_int),)),
    "ncclGetUniqueId": (_RESULT, (ctypes.POINTER(UniqueIdStruct),)),
    "ncclCommInitRank": (_RESULT, (ctypes.POINTER(_P), ctypes.c_int, UniqueIdStruct, ctypes.c_int)),
    "ncclCommInitRankConfig": (
        _RESULT,
        (ctypes.POINTER(_P), ctypes.c_int, UniqueIdStruct, ctypes.c_int, ctypes.POINTER(ConfigStruct)),
    ),
    "ncclCommFinalize": (_RESULT, (_P,)),
    "ncclCommDestroy": (_RESULT, (_P,)),
    "ncclCommAbort": (_RESULT, (_P,)),
    "ncclGetErrorString": (ctypes.c_char_p, (_RESULT,)),
    "ncclGetLastError": (ctypes.c_char_p, (_P,)),
    "ncclCommGetAsyncError": (_RESULT, (_P, ctypes.POINTER(_RESULT))),
    "ncclCommCount": (_RESULT, (_P, ctypes.POINTER(ctypes.c_int))),
    "ncclCommCuDevice": (_RESULT, (_P, ctypes.POINTER(ctypes.c_int))),
    "ncclCommUserRank": (_RESULT, (_P, ctypes.POINTER(ctypes.c_int))),
    "ncclReduce": (_RESULT, (*_COLL, ctypes.c_int, ctypes.c_int, _P, _P)),
    "ncclBroadcast": (_RESULT, (*_COLL, ctypes.c_int, _P, _P)),
    "ncclAllReduce": (_RESULT, (*_COLL, ctypes.c_int, _P, _P)),
    "ncclReduceScatter": (_RESULT, (*_COLL, ctypes.c_int, _P, _P)),
    "ncclAllGather": (_RESULT, (*_COLL, _P, _P)),
    "ncclSend": (_RESULT, (_P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _P, _P)),
    "ncclRecv": (_RESULT, (_P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _P, _P)),
    "ncclGroupStart": (_RESULT, ()),
    "ncclGroupEnd": (_RESULT, ()),
}

#: The release that added each function and enum member newer than NCCL 2.12.
ADDED_IN: dict[str, tuple[int, int, int]] = {
    "ncclGetLastError": (2, 13, 0),
    "ncclCommInitRankConfig": (2, 14, 0),
    "ncclCommFinalize": (2, 14, 0),
    "ncclFloat8e4m3": (2, 24, 0),
    "ncclFloat8e5m2": (2, 24, 0),
    "ncclTimeout": (2, 30, 0),
}

#: Functions that older releases lack; the rest must exist.
OPTIONAL = frozenset(name for name in ADDED_IN if name in PROTOTYPES)


class NcclLibrary:
    """A loaded ``libnccl.so.2`` with every function of :data:`PROTOTYPES` typed.

    Call NCCL functions as attributes (``lib.ncclAllReduce(...)``); they return the raw
    ``ncclResult_t`` integer, which :func:`ferrodist.nccl._status.check` turns into errors.
    """

    def __init__(self, path: str) -> None:
        try:
            self._dll = ctypes.CDLL(path)
        except OSError as exc:
            raise BackendUnavailable(f"cannot load the NCCL library {path!r} ({exc}); {_INSTALL_HINT}") from exc
        self.path = path
        self._functions: dict[str, Callable[..., Any]] = {}
        for name, (restype, argtypes) in PROTOTYPES.items():
            try:
                function = getattr(self._dll, name)
            except AttributeError:
                if name in OPTIONAL:
                    continue
                raise BackendUnavailable(
                    f"{path!r} has no {name}(): it is not libnccl or it is too old; "
                    f"ferrodist needs NCCL >= 2.18; {_INSTALL_HINT}"
                ) from None
            function.restype = restype
            function.argtypes = list(argtypes)
            self._functions[name] = function

    def has(self, name: str) -> bool:
        """True if this library exports ``name``."""
        return name in self._functions

    def __getattr__(self, name: str) -> Any:
        functions = self.__dict__.get("_functions", {})
        if name in functions:
            return functions[name]
        if name in PROTOTYPES:
            since = ADDED_IN.get(name)
            added = f" (added in NCCL {'.'.join(map(str, since))})" if since else ""
            raise BackendUnavailable(
                f"the NCCL library {self.path!r} (NCCL {'.'.join(map(str, self.version))}) lacks {name}(){added}; "
                f"{_INSTALL_HINT}"
            )
        raise AttributeError(name)

    @property
    def version(self) -> tuple[int, int, int]:
        """The loaded library's ``(major, minor, patch)``, from ``ncclGetVersion``."""
        code = ctypes.c_int()
        status = self.ncclGetVersion(ctypes.byref(code))
        if status != Result.ncclSuccess:
            raise BackendUnavailable(f"ncclGetVersion failed with status {status} in {self.path!r}")
        value = code.value
        if value < 10000:  # releases up to 2.8 used X*1000 + Y*100 + Z
            return value // 1000, value % 1000 // 100, value % 100
        return value // 10000, value % 10000 // 100, value % 100

    def error_string(self, status: int) -> str:
        """NCCL's own text for a status (``ncclGetErrorString``)."""
        text = self.ncclGetErrorString(int(status))
        return text.decode(errors="replace") if text else ""

    def last_error(self, comm: int | None = None) -> str:
        """NCCL's description of its last error (``ncclGetLastError``), or ``""``."""
        if not self.has("ncclGetLastError"):
            return ""
        text = self.ncclGetLastError(comm)
        return text.decode(errors="replace") if text else ""


def _wheel_candidates() -> list[Path]:
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(location) / "lib" / "libnccl.so.2" for location in spec.submodule_search_locations]


def find_library_path() -> str:
    """Where ``libnccl.so.2`` is: ``$FERRODIST_NCCL_LIB``, else the nvidia-nccl wheel, else the system.

    Raises:
        BackendUnavailable: none of them has it.
    """
    configured = os.environ.get(ENV_VAR)
    if configured:
        path = Path(configured).expanduser()
        if path.is_dir():
            path = path / "libnccl.so.2"
        if not path.is_file():
            raise BackendUnavailable(
                f"{ENV_VAR}={configured!r} does not name a file; point it at libnccl.so.2, "
                "or unset it to use the NCCL wheel (pip install nvidia-nccl-cu12)"
            )
        return str(path)
    for candidate in _wheel_candidates():
        if candidate.is_file():
            return str(candidate)
    system = ctypes.util.find_library("nccl")
    if system:
        return system
    raise BackendUnavailable(f"the NCCL library (libnccl.so.2) was not found; {_INSTALL_HINT}")


@functools.cache
def _load(path: str) -> NcclLibrary:
    return NcclLibrary(path)


def load_library() -> NcclLibrary:
    """The NCCL library, loaded once per path (see :func:`find_library_path`)."""
    return _load(find_library_path())


def library_path() -> str:
    """The path of the NCCL library ferrodist uses (loading it to check that it works)."""
    return load_library().path


def is_available() -> bool:
    """True if the NCCL library can be found and loaded (a GPU is not needed for this)."""
    try:
        load_library()
    except BackendUnavailable:
        return False
    return True


def nccl_version() -> tuple[int, int, int]:
    """The loaded NCCL's ``(major, minor, patch)``, e.g. ``(2, 32, 3)``."""
    return load_library().version
