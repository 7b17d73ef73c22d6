"""``MemoryStore``: the store's interface for ranks that are threads of one process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from ferrodist.core import CollectiveTimeout
from ferrodist.transport._protocol import DEFAULT_TIMEOUT

__all__ = ["MemoryStore"]


class MemoryStore:
    """An in-process key-value store with the methods of ``StoreClient`` (``timeout=``
    defaults to the one given here; only ``get`` and ``wait`` ever wait)."""

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._timeout = timeout

    def set(self, key: str, value: bytes | str, *, timeout: float | None = None) -> None:
        with self._cond:
            self._data[key] = value.encode() if isinstance(value, str) else bytes(value)
            self._cond.notify_all()

    def get(self, key: str, *, timeout: float | None = None) -> bytes:
        self.wait([key], timeout=timeout)
        with self._cond:
            return self._data[key]

    def add(self, key: str, amount: int, *, timeout: float | None = None) -> int:
        with self._cond:
            total = int(self._data.get(key, b"0")) + int(amount)
            self._data[key] = str(total).encode()
            self._cond.notify_all()
            return total

    def wait(self, keys: Iterable[str], *, timeout: float | None = None) -> None:
        names = list(keys)
        limit = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._cond:
            while not all(k in self._data for k in names):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [k for k in names if k not in self._data]
                    raise CollectiveTimeout(f"store: keys {missing} were not set within {limit:g} s")
                self._cond.wait(left)

    def check(self, keys: Iterable[str], *, timeout: float | None = None) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def delete(self, key: str, *, timeout: float | None = None) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None
