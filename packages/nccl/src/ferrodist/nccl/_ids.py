"""``ncclUniqueId``: what rank 0 makes and every rank of a new communicator is given, made
through the library and checked as NCCL's status says (``_status``)."""

from __future__ import annotations

import ctypes

from ._library import UNIQUE_ID_BYTES, NcclLibrary, Result, UniqueIdStruct, load_library
from ._status import error_for

__all__ = ["get_unique_id"]


def get_unique_id(library: NcclLibrary | None = None) -> bytes:
    """A new ``ncclUniqueId`` as :data:`UNIQUE_ID_BYTES` bytes (works without a GPU), from
    ``library`` (default: the one ferrodist loads).

    Example::

        uid = get_unique_id()      # rank 0; send these 128 bytes to every rank
    """
    library = library or load_library()
    uid = UniqueIdStruct()
    status = library.ncclGetUniqueId(ctypes.byref(uid))
    if status != Result.ncclSuccess:
        raise error_for(status, "ncclGetUniqueId", library=library)
    return bytes(ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES))
