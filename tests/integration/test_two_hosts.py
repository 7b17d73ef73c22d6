"""Two "hosts": network namespaces joined by a veth pair, one rank in each.

Each namespace has its own network stack, so the ranks only reach each other over the
veth link, with addresses that are not loopback: this exercises address selection
(``FERRODIST_SOCKET_IFNAME``), rendezvous and the data path as across machines. Needs root
and iproute2 (``ip netns``); skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 to make network namespaces")
    tag = f"fd{os.getpid() % 100000}"
    a, b = f"{tag}a", f"{tag}b"
    try:
        ip("netns", "add", a)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode().strip()}")
    try:
        ip("netns", "add", b)
        ip("link", "add", f"{tag}x", "type", "veth", "peer", "name", f"{tag}y")
        ip("link", "set", f"{tag}x", "netns", a)
        ip("link", "set", f"{tag}y", "netns", b)
        for ns, dev, addr in ((a, f"{tag}x", "10.231.7.1/24"), (b, f"{tag}y", "10.231.7.2/24")):
            ip("-n", ns, "addr", "add", addr, "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield (a, f"{tag}x"), (b, f"{tag}y")
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


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
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=240)[0])
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, out
        assert f"rank {rank} of 2:" in out and "cases passed over tcp" in out
