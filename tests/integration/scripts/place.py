"""Run by the start tests (test_starts.py, test_two_hosts.py, tests/launch/test_nodes.py):
`place.py BACKEND [TIMEOUT]`.

Joins the job with ``init_process_group(BACKEND)``, checks one all_reduce against the
closed form, and prints one line with where the launcher put this process and what the
backend chose::

    place rank=2 world=4 local=0 local_world=2 transport=TcpTransport sum=ok derived=[...]
"""

from __future__ import annotations

import os
import sys

import numpy as np

import ferrodist.collectives as dist
from ferrodist.transport import launch_info


def main() -> None:
    backend = sys.argv[1]
    timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
    info = launch_info()
    dist.init_process_group(backend, timeout=timeout)
    rank, size = dist.get_rank(), dist.get_world_size()
    x = np.array([rank + 1.0], np.float64)
    dist.all_reduce(x)
    ok = x.tolist() == [size * (size + 1) / 2]
    transport = type(dist.default_group().transport).__name__
    local_world = os.environ.get("LOCAL_WORLD_SIZE", info.local_world_size if info else None)
    derived = list(info.derived) if info else []
    print(
        f"place rank={rank} world={size} local={info.local_rank if info else 0} local_world={local_world} "
        f"transport={transport} sum={'ok' if ok else x.tolist()} derived={derived}",
        flush=True,
    )
    dist.destroy_process_group()
    if not ok:
        sys.exit(3)


if __name__ == "__main__":
    main()
