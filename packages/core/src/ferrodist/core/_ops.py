"""Reduction operations."""

from __future__ import annotations

import enum

from ._errors import InvalidArgument

__all__ = ["ReduceOp"]


class ReduceOp(enum.Enum):
    """How a reducing collective combines the ranks' values.

    ``AVG`` is the sum divided by the number of ranks (floating dtypes only);
    ``BAND``, ``BOR`` and ``BXOR`` are bitwise (integer and bool dtypes only).
    For bool, ``SUM`` and ``MAX`` are a logical or, ``PRODUCT`` and ``MIN`` a
    logical and, as in numpy.
    """

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    AVG = 4
    BAND = 5
    BOR = 6
    BXOR = 7

    # Members are singletons compared by identity: hashed by identity too, in C, not by name
    # in Python (an op is part of the keys every call looks up).
    __hash__ = object.__hash__

    @classmethod
    def coerce(cls, value: object) -> ReduceOp:
        """Accept a ``ReduceOp`` or its name in any case (``"sum"``, ``"Max"``)."""
        if isinstance(value, ReduceOp):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        names = ", ".join(cls.__members__)
        raise InvalidArgument(f"{value!r} is not a reduce op; use one of ReduceOp.{{{names}}}")

    def divisor(self, sources: int) -> float:
        """What the combined value is divided by when ``sources`` values were combined:
        ``sources`` for ``AVG``, 1 for every other op."""
        return float(sources) if self is ReduceOp.AVG else 1.0

    @property
    def combine(self) -> ReduceOp:
        """The op that combines the values before ``divisor`` divides them: ``SUM`` for
        ``AVG`` (a step that reduces part of the ranks adds; the last one divides), the op
        itself for every other op."""
        return ReduceOp.SUM if self is ReduceOp.AVG else self

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"
