"""Where a chunk lies in the shared-memory slots: the block each rank reduces, the view of
a rank's slot, and the source of a rank's block (its own array, or a peer's slot). Inlined
into the compiled loops of ``loops`` and ``halves``."""

from __future__ import annotations

from ferrodist.core.kernels import jit

__all__ = ["bounds", "slot", "source"]


@jit(inline="always")
def bounds(m, p, q):  # type: ignore[no-untyped-def]
    """Rank q's block of an m-element chunk (the split of ``stepwise.split``)."""
    base, extra = m // p, m % p
    start = q * base + min(q, extra)
    return start, start + base + (1 if q < extra else 0)


@jit(inline="always")
def slot(data, x, q, s, slots, chunk, m):  # type: ignore[no-untyped-def]
    """Rank q's slot s, its first m elements viewed as x's dtype."""
    start = (q * slots + s) * chunk
    return data[start : start + m * x.itemsize].view(x.dtype)


@jit(inline="always")
def source(data, x, part, me, q, s, slots, chunk, m):  # type: ignore[no-untyped-def]
    """Block source of rank q: this rank's ``part``, else rank q's slot."""
    return part if q == me else slot(data, x, q, s, slots, chunk, m)
