"""``preload``: the kernels of a job's collectives loaded into one process, so that ranks
forked from it afterwards start their groups and make their first calls without loading
any (what a harness forking each test's ranks from one parent wants)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import ferrodist.collectives as dist
from ferrodist.core import CollectiveTimeout, float32

#: Forks two ranks from a parent that preloaded, each starting a shm group and calling
#: collectives with FERRODIST_DEBUG=compile (which logs every kernel a process loads or compiles).
FORKED = """
import os, socket, sys
import numpy as np
import ferrodist.collectives as dist

print("preloaded", dist.preload(["float32"], ranks=2), flush=True)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
children = []
for rank in range(2):
    pid = os.fork()
    if pid == 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        group = dist.init_process_group("shm", timeout=60)
        x = np.ones(1000, np.float32)
        dist.all_reduce(x)
        dist.all_reduce(np.ones(300_000, np.float32), "max")
        dist.broadcast(x, 1)
        assert x[0] == 2.0
        print(f"rank {rank}: done", flush=True)
        dist.destroy_process_group()
        os._exit(0)
    children.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
print("children", codes, flush=True)
"""


def test_preload_loads_every_kernel_of_the_list_into_this_process():
    items = dist.collective_kernels([float32], ranks=2)
    assert dist.preload(["float32"], ranks=2) == len(items)
    for front, types in items:
        assert tuple(types) in front.overloads, (front.py_func.__qualname__, types)


def test_ranks_forked_after_preload_load_and_compile_nothing(tmp_path):
    env = {**os.environ, "FERRODIST_DEBUG": "compile"}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "FERRODIST_TOKEN"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FORKED)],
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream, in the order things happened
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout
    assert "children [0, 0]" in done.stdout, done.stdout
    assert "rank 0: done" in done.stdout and "rank 1: done" in done.stdout
    lines = done.stdout.splitlines()
    after = lines[next(i for i, line in enumerate(lines) if line.startswith("preloaded")) + 1 :]
    # the parent's own loads are logged before "preloaded"; the children must log none
    assert not [line for line in after if line.startswith("ferrodist compile:")], "\n".join(after)


def test_preload_says_how_to_go_on_when_it_runs_out_of_time(monkeypatch):
    from ferrodist.collectives import _kernels

    class Never:
        failed = None

        def wait(self, timeout):
            return False

    monkeypatch.setattr(_kernels, "prepare", lambda items, always: Never())
    with pytest.raises(CollectiveTimeout, match="ferrodist warm"):
        dist.preload(["float32"], ranks=2, timeout=0.01)


def test_its_dtypes_are_what_ferrodist_warm_compiles():
    warm = pytest.importorskip("ferrodist.launch._warm", reason="ferrodist-launch is not installed")
    assert warm.DEFAULT_DTYPES == dist.DEFAULT_DTYPES
