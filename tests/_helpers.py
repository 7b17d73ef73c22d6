"""Helpers shared by the test modules (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import os

#: The dev hypothesis profile looks five times harder than CI.
EXAMPLE_SCALE = 5 if os.environ.get("FERRODIST_HYPOTHESIS_PROFILE") == "dev" else 1


def examples(count: int) -> int:
    """The number of hypothesis examples for a test whose CI count is ``count``."""
    return count * EXAMPLE_SCALE


def simulator_only(what: str) -> object:
    """A marker that skips a test off Numba's CUDA simulator, saying why: ``what`` is what
    the test drives that only exists there (a stand-in driver, a stand-in NCCL)."""
    import pytest

    return pytest.mark.skipif(
        os.environ.get("NUMBA_ENABLE_CUDASIM") != "1",
        reason=f"runs on Numba's CUDA simulator only (NUMBA_ENABLE_CUDASIM=1): {what}",
    )


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def tcp_world(world_size: int, *, timeout: float = 30.0, token: bytes = b"test-token") -> list:
    """``world_size`` TcpTransports of one job, connected from threads of this process."""
    import threading

    from ferrodist.transport import TcpTransport

    port = free_port()
    transports: list = [None] * world_size
    errors: list = []

    def join(rank: int) -> None:
        try:
            transports[rank] = TcpTransport.connect(
                rank=rank,
                world_size=world_size,
                master_addr="127.0.0.1",
                master_port=port,
                timeout=timeout,
                token=token,
            )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 5)
    if errors:
        for t in transports:
            if t is not None:
                t.close()
        raise errors[0]
    return transports


def two_network_namespaces(tag: str, subnet: str, *, rate: str | None = None, delay: str | None = None):  # type: ignore[no-untyped-def]
    """Two network namespaces joined by a veth pair, as two "hosts": a generator for a pytest
    fixture that yields ``[(namespace, device, address), ...]`` (``subnet``.1 and .2) and
    deletes them afterwards (``ferrodist.testing.two_hosts``; ``rate``/``delay`` shape the
    link). Skips the test without root or iproute2."""
    import pytest

    from ferrodist.testing import NamespacesUnavailable, two_hosts

    try:
        link = two_hosts(tag, subnet, rate=rate, delay=delay)
        made = link.__enter__()
    except NamespacesUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield [(h.namespace, h.device, h.address) for h in made.hosts]
    finally:
        link.__exit__(None, None, None)


def communicate_all(procs, timeout: float) -> list[str]:  # type: ignore[no-untyped-def]
    """Each process's output (stdout, text) once it exits, within ``timeout`` seconds each;
    every process is killed afterwards, whatever happened."""
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            proc.kill()
    return outputs
