"""Building blocks for compiled loops over ferrodist's dtypes, for ferrodist's own packages
(the shared-memory pipelines of ``ferrodist.transport``) and for your own Numba code.

- :func:`jit`: ``numba.njit`` with ``cache=True, nogil=True``, its disk cache locked so that
  processes compiling at once cannot mix up entries.
- :func:`combine`, :func:`load`, :func:`store`, :func:`finish`: use inside a jitted function;
  with the op and the element kind as compile-time constants (module globals or closure
  integers) each compiles to the one operation it names.
- :func:`fold_kernel`: the compiled k-way reduction for one (kind, opcode, divide, place of
  the destination); :func:`plan`: which kind, view and opcode a (dtype, op) folds with.
- :func:`copy_into`, :func:`load_acquire`, :func:`store_release`: a ``memcpy`` of one array
  into another, and atomic word accesses for memory shared between processes.

Example:
    >>> import numpy as np
    >>> from ferrodist.core.kernels import SUM, PLAIN, fold_kernel
    >>> add = fold_kernel(PLAIN, SUM, False, -1)
    >>> out = np.empty(3)
    >>> add(out, (np.ones(3), np.full(3, 2.0)), 1.0)
    >>> out
    array([3., 3., 3.])
"""

from ._jit import copy_into, jit, load_acquire, store_release
from ._kernels import (
    AVG,
    BAND,
    BF16,
    BOR,
    BXOR,
    F16,
    MAX,
    MIN,
    PLAIN,
    PRODUCT,
    SUM,
    combine,
    finish,
    fold_kernel,
    load,
    store,
)
from ._reduce import MAX_FUSED_SOURCES, pairwise_opcode, plan

__all__ = [
    "AVG",
    "BAND",
    "BF16",
    "BOR",
    "BXOR",
    "F16",
    "MAX",
    "MAX_FUSED_SOURCES",
    "MIN",
    "PLAIN",
    "PRODUCT",
    "SUM",
    "combine",
    "copy_into",
    "finish",
    "fold_kernel",
    "jit",
    "load",
    "load_acquire",
    "pairwise_opcode",
    "plan",
    "store",
    "store_release",
]
