"""Two "hosts": network namespaces joined by a veth pair, one rank in each.

Each namespace has its own network stack, so the ranks only reach each other over the
veth link, with addresses that are not loopback: this exercises address selection
(``FERRODIST_SOCKET_IFNAME``), rendezvous and the data path as across machines. Needs root
and iproute2 (``ip netns``); skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import communicate_all, two_network_namespaces

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture
def two_hosts():
    """(namespace, device) of each "host"."""
    for hosts in two_network_namespaces("fd", "10.231.7"):
        yield [(ns, dev) for ns, dev, _ in hosts]


def test_a_job_across_two_network_stacks(two_hosts):
    env = dict(
        os.environ,
        WORLD_SIZE="2",
        MASTER_ADDR="10.231.7.1",
        MASTER_PORT="29531",
        FERRODIST_TOKEN=secrets.token_hex(16),
        PYTHONUNBUFFERED="1",
    )
    procs = []
    for rank, (ns, dev) in enumerate(two_hosts):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK="0", FERRODIST_SOCKET_IFNAME=dev)
        command = ["ip", "netns", "exec", ns, sys.executable, str(SCRIPTS / "properties.py"), "150", "tcp"]
        procs.append(
            subprocess.Popen(command, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outputs = communicate_all(procs, 240)
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, out
        assert f"rank {rank} of 2:" in out and "cases passed over tcp" in out
