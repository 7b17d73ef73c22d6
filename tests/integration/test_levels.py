"""Jobs over two nodes run their collectives over two levels: shared memory inside each node,
tcp between. Two launchers of one job on 127.0.0.1 (nodes by the launchers' numbers), and
two network namespaces joined by a shaped veth link (nodes that reach each other only over
the link; skipped where namespaces cannot be made). Every rank checks every collective
the levels run (scripts/levels.py)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import communicate_all, free_port, two_network_namespaces

pytest.importorskip("ferrodist.launch", reason="ferrodist-launch is not installed (pip install packages/launch)")

SCRIPT = Path(__file__).parent / "scripts" / "levels.py"
_PLACE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def _launchers(counts: list[int], prefixes: list[list[str]], master: str, envs: list[dict[str, str]]) -> list[str]:
    """One ``ferrodist run`` per node (node k runs ``counts[k]`` ranks, under ``prefixes[k]``);
    every launcher's output once all have exited (within two minutes)."""
    base = {k: v for k, v in os.environ.items() if k not in _PLACE and not k.startswith(("OMPI_", "SLURM_"))}
    base.update(FERRODIST_TOKEN=secrets.token_hex(16), PYTHONUNBUFFERED="1")
    port = free_port()
    procs = []
    for node, (count, prefix, env) in enumerate(zip(counts, prefixes, envs, strict=True)):
        argv = [sys.executable, "-m", "ferrodist.launch", "run", "--nnodes", str(len(counts)), "--node-rank"]
        argv += [str(node), "--master-addr", master, "--master-port", str(port), "-n", str(count), str(SCRIPT)]
        procs.append(
            subprocess.Popen(
                [*prefix, *argv], env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = communicate_all(procs, 120)
    assert [p.returncode for p in procs] == [0] * len(procs), outputs
    return outputs


def _said(outputs: list[str]) -> dict[int, str]:
    lines = [line for out in outputs for line in out.splitlines() if "levels ok" in line]
    return {int(line.split("]")[0].split()[-1]): line for line in lines}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("counts", [[2, 2], [2, 1]])
def test_two_launchers_on_one_machine_run_every_collective_over_two_levels(counts):
    said = _said(_launchers(counts, [[], []], "127.0.0.1", [{}, {}]))
    assert sorted(said) == list(range(sum(counts)))
    for rank, line in said.items():
        alone = counts[1] == 1 and rank == sum(counts) - 1
        expected = "inner=None arena=no" if alone else "inner=ShmTransport arena=yes"
        assert f"backend=levels {expected} checks=67" in line, line


@pytest.mark.timeout(180)
def test_nodes_in_network_namespaces_over_a_shaped_link():
    for hosts in two_network_namespaces("fv", "10.231.11", rate="1gbit", delay="200us"):
        prefixes = [["ip", "netns", "exec", ns] for ns, _, _ in hosts]
        envs = [{"FERRODIST_SOCKET_IFNAME": dev} for _, dev, _ in hosts]
        said = _said(_launchers([2, 2], prefixes, hosts[0][2], envs))
        assert sorted(said) == [0, 1, 2, 3]
        assert all("backend=levels inner=ShmTransport arena=yes checks=67" in line for line in said.values()), said
