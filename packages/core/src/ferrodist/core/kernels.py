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
- :func:`background`, :func:`prepare`, :class:`NotCompiled`, :func:`wait_for_compiles`: call a
  kernel from Python without ever compiling in the caller's thread; the compile runs on a
  background thread while the caller runs an interpreted path, such as :func:`fold_numpy`
  (what :func:`fold_kernel` computes, in numpy, the same bits).
- :func:`to_bfloat16`, :func:`from_bfloat16`: float32 arrays to bfloat16 bits and back
  (twins: compiled, or numpy while compiling); :func:`through_bfloat16`: run a step on the
  bfloat16 rounding of an array and widen its result back.
- :class:`Twin`: a compiled loop and its interpreted twin as one callable: the compiled code
  where it is loaded, else the twin while the compile runs in the background; :class:`Later`:
  a family of loops whose compiles are queued after a number of misses.
- :func:`warm`, :func:`cached`, :func:`reduction_kernels`: fill the disk cache ahead of a
  job (``ferrodist warm``), and count what it holds.

Example:
    >>> import numpy as np
    >>> from ferrodist.core.kernels import SUM, PLAIN, fold_kernel
    >>> add = fold_kernel(PLAIN, SUM, False, -1)
    >>> out = np.empty(3)
    >>> add(out, (np.ones(3), np.full(3, 2.0)), 1.0)
    >>> out
    array([3., 3., 3.])
"""

from ._casts import from_bfloat16, through_bfloat16, to_bfloat16
from ._compile.background import NotCompiled, Ticket, background, prepare, wait_for_compiles
from ._compile.jit import copy_into, jit, load_acquire, store_release
from ._compile.twin import Later, Twin
from ._interpreted import fold as fold_numpy
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
from ._warm import Warmed, cached, reduction_kernels, warm

__all__ = [
    "AVG",
    "BAND",
    "BF16",
    "BOR",
    "BXOR",
    "F16",
    "Later",
    "MAX",
    "MAX_FUSED_SOURCES",
    "MIN",
    "NotCompiled",
    "PLAIN",
    "PRODUCT",
    "SUM",
    "Ticket",
    "Twin",
    "Warmed",
    "background",
    "cached",
    "combine",
    "copy_into",
    "finish",
    "fold_kernel",
    "fold_numpy",
    "from_bfloat16",
    "jit",
    "load",
    "load_acquire",
    "pairwise_opcode",
    "plan",
    "prepare",
    "reduction_kernels",
    "store",
    "store_release",
    "through_bfloat16",
    "to_bfloat16",
    "wait_for_compiles",
    "warm",
]
