"""Helpers shared by the test modules (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import os

#: The dev hypothesis profile looks five times harder than CI.
EXAMPLE_SCALE = 5 if os.environ.get("FERRODIST_HYPOTHESIS_PROFILE") == "dev" else 1


def examples(count: int) -> int:
    """The number of hypothesis examples for a test whose CI count is ``count``."""
    return count * EXAMPLE_SCALE
