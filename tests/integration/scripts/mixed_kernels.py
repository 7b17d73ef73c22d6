"""Run by tests/integration/test_cold_cache.py as
`ferrodist run -n N mixed_kernels.py RANKS CASES shm`: properties.py (CASES cases over shm)
with the ranks listed in RANKS (comma-separated) running ferrodist's interpreted paths only
(``FERRODIST_KERNELS=interpreted``) and the others its compiled loops, as ranks do while
some of them still compile: every result must still be right and every rank's bits the
same (the shm all_reduce and reduce results are checked against the kernels' bits)."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

interpreted = sys.argv.pop(1).split(",")
if os.environ["RANK"] in interpreted:
    os.environ["FERRODIST_KERNELS"] = "interpreted"  # read when a compile is first asked for
runpy.run_path(str(Path(__file__).with_name("properties.py")), run_name="__main__")
