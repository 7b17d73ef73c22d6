"""How big the shared-memory arena's slots are: chosen from the machine's caches."""

from __future__ import annotations

import os

__all__ = ["DEFAULT_CHUNK", "DEFAULT_SLOTS", "default_chunk"]

DEFAULT_CHUNK = 1 << 20  # bytes per slot where a core's L2 cache size cannot be read
DEFAULT_SLOTS = 2
_L2 = "/sys/devices/system/cpu/cpu0/cache/index2"


def default_chunk(cache: str = _L2) -> int:
    """Bytes per slot: half a core's L2 cache, from 256 KiB to 1 MiB (so that a chunk of
    ``x``, the slots it meets and the peers' parts stay in the core's L2 while they are
    folded); ``DEFAULT_CHUNK`` where Linux does not say the cache's size."""
    try:
        with open(os.path.join(cache, "level")) as level, open(os.path.join(cache, "size")) as size:
            if level.read().strip() != "2":
                return DEFAULT_CHUNK
            text = size.read().strip().upper()
        units = {"K": 1 << 10, "M": 1 << 20}
        l2 = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
    except (OSError, ValueError):
        return DEFAULT_CHUNK
    return min(1 << 20, max(256 << 10, l2 // 2 // 64 * 64))
