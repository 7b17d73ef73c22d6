"""Helpers shared by the test modules (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import os

#: The dev hypothesis profile looks five times harder than CI.
EXAMPLE_SCALE = 5 if os.environ.get("FERRODIST_HYPOTHESIS_PROFILE") == "dev" else 1


def examples(count: int) -> int:
    """The number of hypothesis examples for a test whose CI count is ``count``."""
    return count * EXAMPLE_SCALE


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
