"""Fill Numba's on-disk cache while the test session runs (started by tests/conftest.py).

`make test` runs `ferrodist warm` before the tests (the common dtypes); this compiles the
rest that tests use (every dtype, up to 8 ranks a host) at the lowest CPU priority, in one
compile helper, on the core the serial test run leaves idle, so that later tests that start
several rank processes load compiled code. It changes no result: a test that needs a kernel
before it is cached gets it compiled as it would have anyway (and a kernel is never
compiled twice at once on this host). ``FERRODIST_WARM_CACHE=0`` turns it off.
"""

from __future__ import annotations

import os


def main() -> None:
    os.nice(19)
    from ferrodist.collectives import collective_kernels
    from ferrodist.core import ALL_DTYPES
    from ferrodist.core.kernels import warm

    result = warm(collective_kernels(list(ALL_DTYPES), ranks=8), processes=1)
    for failure in result.failed:
        print(f"could not compile {failure}")
    raise SystemExit(1 if result.failed else 0)


if __name__ == "__main__":
    main()
