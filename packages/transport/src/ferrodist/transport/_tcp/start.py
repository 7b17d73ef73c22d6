"""What a TCP start needs besides the transport itself: how the job starts (for messages),
telling the ranks already waiting why this process cannot join, and what a failed start
may have to do with (strangers refused meanwhile, where the secret came from)."""

from __future__ import annotations

import copy
import time

from ferrodist.core import AuthenticationFailed, FerrodistError, InvalidArgument
from ferrodist.transport._start.auth import Secret, job_secret, where_to_listen
from ferrodist.transport._start.env import launch_info
from ferrodist.transport._start.net import local_address
from ferrodist.transport._start.rendezvous import Rendezvous, report_bad_start
from ferrodist.transport._start.store import KeyValue

__all__ = ["describe_start", "report_start_failure", "with_start_notes"]


def describe_start(rank: object, master_addr: str | None, master_port: int | None, rendezvous: KeyValue | None) -> str:
    """How the job starts, for messages; ``InvalidArgument`` when ``connect`` was told neither way."""
    if rendezvous is not None:
        if not isinstance(rendezvous, KeyValue):
            raise InvalidArgument(
                f"rank {rank}: TcpTransport.connect: rendezvous= needs get(key) and set(key, value) methods (a "
                f"key-value store such as torch.distributed.TCPStore), not a {type(rendezvous).__name__}"
            )
        return f"the key-value store {type(rendezvous).__name__}"
    if master_addr is None or master_port is None:
        raise InvalidArgument(
            f"rank {rank}: TcpTransport.connect: give master_addr= and master_port= (where rank 0 hosts the store), "
            "or rendezvous= (a key-value store every rank reaches)"
        )
    return f"{master_addr}:{master_port}"


def report_start_failure(
    error: FerrodistError,
    rank: object,
    world_size: object,
    master_addr: str,
    master_port: int,
    token: bytes | None,
    one_host: bool | None,
) -> None:
    """``report_bad_start`` with the job's secret and master address as ``connect`` finds them
    (but no MPI broadcast: this process will not be in the one the others make)."""
    try:
        secret = job_secret(token, -1, -1, launcher=True, deadline=time.monotonic() + 1.0)
        if one_host is None:
            try:
                info = launch_info()
            except InvalidArgument:  # this process's own variables are what is wrong
                info = None
            one_host = info is not None and info.single_host
        master_addr, _ = where_to_listen(
            secret, master_addr, local_address(master_addr), one_host=one_host, rank=-1, world_size=-1, what=""
        )
    except FerrodistError:
        return  # nothing to report to: without a secret, the others refuse to start across hosts
    report_bad_start(rank, world_size, master_addr, master_port, secret.key, error)


def with_start_notes(error: FerrodistError, rdv: Rendezvous | None, secret: Secret) -> FerrodistError:
    """A start's ``error``, with what it may have to do with: connections from outside the
    job that were refused meanwhile, and where this rank's secret came from."""
    note = rdv.outside() if rdv is not None and not rdv.aborted else ""
    if isinstance(error, AuthenticationFailed) and secret.source not in ("", "FERRODIST_TOKEN", "the token given"):
        note += f" (this rank's secret: {secret.source})"
    if not note:
        return error
    noted = copy.copy(error)
    noted.args = (error.message + note,)
    return noted
