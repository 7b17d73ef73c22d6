"""Devices: ``cpu`` and ``cuda:k``."""

from __future__ import annotations

from dataclasses import dataclass

from ._errors import InvalidArgument

__all__ = ["Device", "device"]


@dataclass(frozen=True)
class Device:
    """Where a tensor's bytes live: ``Device("cpu")`` or ``Device("cuda", 0)``."""

    type: str
    index: int | None = None

    def __post_init__(self) -> None:
        if self.type not in ("cpu", "cuda"):
            raise InvalidArgument(f"device type {self.type!r} is unknown; use 'cpu' or 'cuda[:k]'")
        if self.type == "cpu" and self.index not in (None, 0):
            raise InvalidArgument(f"device 'cpu:{self.index}' does not exist; use 'cpu'")
        if self.index is not None and self.index < 0:
            raise InvalidArgument(f"device index {self.index} is negative")

    def __str__(self) -> str:
        if self.type == "cpu" or self.index is None:
            return self.type
        return f"{self.type}:{self.index}"


CPU = Device("cpu")


def device(value: str | Device) -> Device:
    """Parse ``"cpu"``, ``"cuda"`` or ``"cuda:1"`` (or pass a ``Device`` through)."""
    if isinstance(value, Device):
        return value
    if not isinstance(value, str):
        raise InvalidArgument(f"device must be a string like 'cpu' or 'cuda:0', not {value!r}")
    kind, sep, index = value.partition(":")
    if not sep:
        return CPU if kind == "cpu" else Device(kind)
    if not index.isdigit():
        raise InvalidArgument(f"device {value!r}: the index after ':' must be a non-negative integer")
    return Device(kind, int(index))
