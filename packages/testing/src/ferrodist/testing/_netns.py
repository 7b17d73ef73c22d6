"""Nodes on one machine: network namespaces joined by a veth pair, the link shaped with tc.

Each namespace has its own network stack, so ranks started in different namespaces reach
each other only over the veth link, with addresses that are not loopback, as ranks on two
machines do; ranks started in one namespace share its host (shared memory works between
them). ``tc`` shapes each end of the link: netem's rate and delay where the kernel has it,
else tbf's rate alone (``Link.shaping`` says which). Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Host", "Link", "NamespacesUnavailable", "two_hosts"]


class NamespacesUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, no iproute2, no permission)."""


@dataclass(frozen=True)
class Host:
    """One "machine": its namespace, its end of the link and its address there."""

    namespace: str
    device: str
    address: str

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


@dataclass(frozen=True)
class Link:
    """The two hosts and what shapes the link between them (``"none"`` when unshaped)."""

    hosts: tuple[Host, Host]
    shaping: str
    #: bits per second each way, when shaped
    rate: float | None = None
    #: one-way delay in seconds added by the shaping (0 where netem is missing)
    delay: float = 0.0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _rate_bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"a rate such as 10gbit or 100mbit, not {rate!r}")


def _delay_seconds(delay: str) -> float:
    for unit, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if delay.endswith(unit):
            return float(delay[: -len(unit)]) * scale
    raise ValueError(f"a delay such as 50us or 1ms, not {delay!r}")


def _shape(host: Host, rate: str, delay: str | None) -> str:
    """Shape ``host``'s end of the link; what was applied, in words."""
    dev = ["tc", "qdisc", "replace", "dev", host.device, "root"]
    netem = [*dev, "netem", "rate", rate, *(["delay", delay] if delay else [])]
    done = subprocess.run(host.command(*netem), capture_output=True, text=True, timeout=30)
    if done.returncode == 0:
        return f"netem rate {rate}" + (f" delay {delay}" if delay else "")
    # tbf: a bucket of at least one timer tick's worth of bytes (HZ 100 at worst), or 64 KiB
    burst = max(64 * 1024, int(_rate_bits(rate) / 8 / 100))
    tbf = [*dev, "tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]
    subprocess.run(host.command(*tbf), check=True, capture_output=True, timeout=30)
    return f"tbf rate {rate}" + (f" (no delay: this kernel has no netem: {done.stderr.strip()})" if delay else "")


@contextlib.contextmanager
def two_hosts(tag: str, subnet: str, *, rate: str | None = None, delay: str | None = None) -> Iterator[Link]:
    """Two namespaces ``<tag>a`` and ``<tag>b`` joined by a veth pair, addresses ``subnet``.1
    and .2 (``subnet`` as ``"10.231.7"``), the link shaped to ``rate`` (``"10gbit"``) and
    ``delay`` (``"50us"``) each way when given; deleted on exit.

    Raises ``NamespacesUnavailable`` (with the reason) where they cannot be made.
    """
    if shutil.which("ip") is None or os.geteuid() != 0:
        raise NamespacesUnavailable("needs root and iproute2 (ip netns) to make network namespaces")
    tag = f"{tag}{os.getpid() % 100000}"
    names = (f"{tag}a", f"{tag}b")
    try:
        _ip("netns", "add", names[0])
    except subprocess.CalledProcessError as exc:
        raise NamespacesUnavailable(f"cannot create network namespaces here: {exc.stderr.decode().strip()}") from None
    try:
        _ip("netns", "add", names[1])
        _ip("link", "add", f"{tag}x", "type", "veth", "peer", "name", f"{tag}y")
        hosts = []
        for ns, dev, last in ((names[0], f"{tag}x", 1), (names[1], f"{tag}y", 2)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{subnet}.{last}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            hosts.append(Host(ns, dev, f"{subnet}.{last}"))
        shaping, seconds = "none", 0.0
        if rate is not None:
            shaping = "; ".join(dict.fromkeys(_shape(h, rate, delay) for h in hosts))
            seconds = _delay_seconds(delay) if delay and shaping.startswith("netem") else 0.0
        yield Link((hosts[0], hosts[1]), shaping, _rate_bits(rate) if rate else None, seconds)
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
