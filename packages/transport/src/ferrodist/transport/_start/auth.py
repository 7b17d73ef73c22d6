"""Challenge-response authentication of every connection with the job's secret.

Both ends prove they hold the secret without sending it: the server sends a random
nonce, the client answers HMAC-SHA256(secret, "client" + nonce) with a nonce of its own,
and the server answers HMAC-SHA256(secret, "server" + client nonce). A process without
the secret (or with another job's) is refused before any data is exchanged. The secret
never appears in a message or an error.

Where the secret comes from (``TcpTransport.connect``): ``FERRODIST_TOKEN`` (``ferrodist run``
makes one per job); else what the launcher already shares (``launcher_secret``: under SLURM
the job id keyed with a per-user file, under mpiexec a broadcast over MPI; under torchrun
rank 0 makes one and publishes it through torch's store, see ``rendezvous``). A job with
none of these runs the handshake with an empty key that anyone can compute, so it only
listens on loopback: a job across hosts without a secret is refused before it opens a port.
The first handshake of such a process logs one WARNING (logger ``ferrodist.transport``).

The server side of the handshake runs in steps (``Challenge``), so that one thread can
hold many handshakes at once (``accept``); ``accept_handshake`` is the same, blocking.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ferrodist.core import AuthenticationFailed, CollectiveTimeout, InvalidArgument, ProtocolError

from .env import launch_info
from .net import HANDSHAKE_LIMIT, recv_exact

__all__ = [
    "Challenge",
    "NotFerrodist",
    "Secret",
    "accept_handshake",
    "connect_handshake",
    "job_token",
    "job_secret",
    "launcher_secret",
    "refused",
    "where_to_listen",
]

_MAGIC = b"FDAU"
_NONCE = 32
_ACCEPTED, _REFUSED = b"\x01", b"\x00"
#: The per-user key a SLURM job's secret is derived with (``FERRODIST_SECRET_FILE`` overrides).
DEFAULT_SECRET_FILE = "~/.ferrodist/secret"


class NotFerrodist(ProtocolError):
    """The other end of a connection does not speak the ferrodist handshake.

    Attributes:
        reason: what it did instead, as a clause ("it sent nothing for 5 s ...").
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def job_token() -> bytes:
    """This process's job token, from ``FERRODIST_TOKEN`` (empty: none was given)."""
    return os.environ.get("FERRODIST_TOKEN", "").encode()


@dataclass(frozen=True)
class Secret:
    """A job's key for the handshake, and where it came from (for messages; never the key).

    Attributes:
        key: the key (empty: the job has none).
        source: where it came from (``"FERRODIST_TOKEN"``, ...); with no key, why there is
            none, or an empty string when nothing offered one.
    """

    key: bytes
    source: str


def job_secret(token: bytes | None, rank: int, world_size: int, *, launcher: bool, deadline: float) -> Secret:
    """The secret of this rank's job: ``token`` when given, else ``FERRODIST_TOKEN``, else
    (when ``launcher``: the job starts at ``MASTER_ADDR:MASTER_PORT``, not through a store the
    job already has) what the launcher shares (``launcher_secret``)."""
    if token is not None:
        return Secret(token, "the token given" if token else "")
    if job_token():
        return Secret(job_token(), "FERRODIST_TOKEN")
    return launcher_secret(rank, world_size, deadline=deadline) if launcher else Secret(b"", "")


def where_to_listen(
    secret: Secret, master_addr: str, host: str, *, one_host: bool | None, rank: int, world_size: int, what: str
) -> tuple[str, str]:
    """The master address to use and the address to listen on, for a job that starts at
    ``master_addr`` and whose peers would reach this rank at ``host``: as they are with a
    secret, or on loopback; without one, loopback for a job on one host (``one_host``, or
    the launcher's ``LOCAL_WORLD_SIZE == WORLD_SIZE`` when None), else ``InvalidArgument``:
    a job across hosts without a secret would be open to every host that reaches its ports.
    """
    if secret.key:
        return master_addr, host
    if _loopback(host):  # the master is on this host's loopback (a name for it, even 0.0.0.0): meet on 127.0.0.1
        return master_addr if _loopback(master_addr) else "127.0.0.1", host
    if one_host is None:
        try:
            info = launch_info()
        except InvalidArgument:
            info = None
        one_host = info is not None and (info.rank, info.world_size) == (rank, world_size) and info.single_host
    if one_host:
        return "127.0.0.1", "127.0.0.1"
    why = f" ({secret.source})" if secret.source else ""
    raise InvalidArgument(
        f"{what}: FERRODIST_TOKEN is not set and the launcher shares no secret{why}, and MASTER_ADDR={master_addr} is "
        "not loopback: without a secret, every host that reaches this job's ports could join it or send it data, so "
        "it is not started. Export the same FERRODIST_TOKEN on every rank (e.g. FERRODIST_TOKEN=$(python -c 'import "
        "secrets; print(secrets.token_hex(32))'), and `mpiexec -x FERRODIST_TOKEN ...`), or start the ranks with "
        "`ferrodist run` or torchrun, which share one; if every rank runs on this host, set LOCAL_WORLD_SIZE to "
        "WORLD_SIZE or MASTER_ADDR=127.0.0.1",
        rank=rank,
    )


def _loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "localhost")


def launcher_secret(
    rank: int, world_size: int, env: Mapping[str, str] | None = None, *, deadline: float | None = None
) -> Secret:
    """The job's secret, derived from what its launcher already shares, for a job without
    ``FERRODIST_TOKEN``; ``Secret(b"", why)`` when there is nothing to derive it from.

    - Under SLURM (``SLURM_JOB_ID``): HMAC-SHA256 of the job id, keyed with a per-user file
      (``FERRODIST_SECRET_FILE``, default ``~/.ferrodist/secret``; made with 32 random bytes,
      mode 0600 in a 0700 directory, the first time). Every node of the job must read the
      same file: a home directory the nodes share.
    - Under mpiexec (Open MPI's, MPICH's or PMIx's variables) with mpi4py installed: 32
      random bytes that rank 0 broadcasts over ``COMM_WORLD``, when ``COMM_WORLD`` is this
      job (its rank and size are ``rank`` and ``world_size``), waited for until ``deadline``.

    Raises:
        InvalidArgument: the SLURM key file is readable by other users, or not this user's.
        CollectiveTimeout: rank 0's MPI broadcast did not come by ``deadline``.
    """
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_ID"):
        return _slurm_secret(env["SLURM_JOB_ID"], env)
    try:
        info = launch_info(env)
    except InvalidArgument:
        info = None
    if info is not None and info.under_mpi and (info.rank, info.world_size) == (rank, world_size):
        return _mpi_secret(rank, world_size, deadline)
    return Secret(b"", "")


def _slurm_secret(job: str, env: Mapping[str, str]) -> Secret:
    path = Path(env.get("FERRODIST_SECRET_FILE") or DEFAULT_SECRET_FILE).expanduser()
    try:
        key = _user_key(path)
    except OSError as exc:
        return Secret(b"", f"SLURM_JOB_ID is set but the key file {path} cannot be made or read ({exc.strerror})")
    secret = hmac.new(key, b"ferrodist slurm job " + job.encode(), hashlib.sha256).hexdigest().encode()
    return Secret(secret, f"SLURM_JOB_ID={job} keyed with {path} (FERRODIST_SECRET_FILE)")


def _user_key(path: Path) -> bytes:
    """The key in ``path``, made first when missing (atomically: a link to a complete file,
    so that processes of the job on several nodes sharing the file all read one key)."""
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        draft = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_hex(32).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(draft, path)
        except FileExistsError:
            pass  # another process of the job made it first: read that one
        finally:
            os.unlink(draft)
    status = path.stat()
    if status.st_uid != os.getuid() or status.st_mode & 0o077:
        raise InvalidArgument(
            f"the key file {path} (FERRODIST_SECRET_FILE), which SLURM jobs derive their secret from, is "
            + ("not this user's" if status.st_uid != os.getuid() else "readable by other users")
            + f": remove it (it is made again), or `chmod 600 {path}`; or export FERRODIST_TOKEN on every rank"
        )
    key = path.read_bytes().strip()
    if not key:
        raise InvalidArgument(f"the key file {path} (FERRODIST_SECRET_FILE) is empty: remove it (it is made again)")
    return key


def _mpi_secret(rank: int, world_size: int, deadline: float | None) -> Secret:
    try:
        from mpi4py import MPI
    except ImportError:
        return Secret(b"", "mpiexec started this job but mpi4py is not installed to share a secret over MPI")
    comm = MPI.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (rank, world_size):
        return Secret(
            b"",
            f"mpi4py's COMM_WORLD is rank {comm.Get_rank()} of {comm.Get_size()}, not this job's rank {rank} of "
            f"{world_size} (mpi4py built for another MPI library?)",
        )
    buffer = bytearray(secrets.token_bytes(32) if rank == 0 else 32)
    request = comm.Ibcast([buffer, MPI.BYTE], root=0)
    delay, give_up = 0.001, time.monotonic() + 300.0 if deadline is None else deadline
    while not request.Test():
        if time.monotonic() >= give_up:
            raise CollectiveTimeout(
                f"rank {rank}: the job's secret, broadcast over MPI by rank 0, did not come in time: is rank 0 "
                "starting the same job?",
                rank=rank,
                waiting_for=(0,),
            )
        time.sleep(delay)
        delay = min(2 * delay, 0.05)
    return Secret(bytes(buffer).hex().encode(), "a secret rank 0 broadcast over MPI (mpi4py)")


#: Whether this process has said that its job accepts anyone (it says so once), and whether
#: it leaves that to another rank of the job (see ``say_open``).
_OPEN = {"said": False, "left": False}
#: How to close an open job, at the end of what is said.
CLOSE_IT = (
    "Export the same secret on every rank, e.g. FERRODIST_TOKEN=$(python -c 'import secrets; "
    "print(secrets.token_hex(32))'), or start the ranks with `ferrodist run`, which makes one per job."
)


def say_open(message: str | None) -> None:
    """Log ``message`` (that this job accepts anyone) as a WARNING, once per process.
    None: another rank of the job says it; this one logs nothing, not even the handshakes'
    warning of an open job."""
    if message is None:
        _OPEN["left"] = True
    elif not _OPEN["said"]:
        _OPEN["said"] = True
        logging.getLogger("ferrodist.transport").warning("%s", message)


def _warn_open() -> None:
    if _OPEN["left"]:
        return
    say_open(
        "ferrodist: FERRODIST_TOKEN is not set and the launcher shares no secret, so this job's connections are "
        "not authenticated: its ports listen on loopback only, but any process of this host can join the job "
        f"or send it data. {CLOSE_IT}"
    )


def _mac(token: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, role + nonce, hashlib.sha256).digest()


def _short(deadline: float, limit: float) -> float:
    return min(deadline, time.monotonic() + limit)


class Challenge:
    """The server's side of one handshake, in steps, for a caller that does the reading and
    writing itself (many handshakes in one thread, see ``accept``): send ``greeting``, read
    ``REPLY`` bytes, and send what ``answer`` returns.

    Example::

        challenge = Challenge(token)
        sock.sendall(challenge.greeting)
        accepted, response = challenge.answer(reply)  # reply: the client's REPLY bytes
        sock.sendall(response)                        # our proof, or the refusal
    """

    REPLY = len(_MAGIC) + 32 + _NONCE

    def __init__(self, token: bytes) -> None:
        if not token:
            _warn_open()
        self._token = token
        self._nonce = os.urandom(_NONCE)
        self.greeting = _MAGIC + self._nonce

    def answer(self, reply: bytes, what: str) -> tuple[bool, bytes]:
        """Whether the client holds the token, and what to send it back.

        Raises:
            NotFerrodist: ``reply`` is not the ferrodist handshake (send nothing back).
        """
        if reply[:4] != _MAGIC:
            raise NotFerrodist(
                f"{what}: a connection that does not speak the ferrodist handshake was refused",
                reason="it does not speak the ferrodist handshake",
            )
        proof, client_nonce = reply[4:36], reply[36:]
        if not hmac.compare_digest(proof, _mac(self._token, b"client", self._nonce)):
            return False, _REFUSED
        return True, _ACCEPTED + _mac(self._token, b"server", client_nonce)


def refused(what: str) -> AuthenticationFailed:
    """The error for a connection ``Challenge.answer`` refused."""
    return AuthenticationFailed(f"{what}: refused a connection that does not hold this job's token")


def accept_handshake(
    sock: socket.socket, token: bytes, deadline: float, what: str, *, limit: float = HANDSHAKE_LIMIT
) -> None:
    """Server side, blocking: check the client's proof, then prove ourselves (within ``limit`` seconds)."""
    challenge = Challenge(token)
    sock.sendall(challenge.greeting)
    reply = recv_exact(sock, Challenge.REPLY, _short(deadline, limit), what, peer=-1)
    accepted, response = challenge.answer(reply, what)
    sock.sendall(response)
    if not accepted:
        raise refused(what)


def connect_handshake(
    sock: socket.socket, token: bytes, deadline: float, what: str, peer: int, *, limit: float = HANDSHAKE_LIMIT
) -> None:
    """Client side: answer the challenge, then check the server's proof.

    A ferrodist process sends its challenge as soon as it accepts the connection: when
    none comes within ``limit`` seconds (bounded by ``deadline``), the other end is not
    ferrodist (a program that waits for its client to speak, such as an HTTP server) or is
    stopped, and ``NotFerrodist`` says so. Running out of ``deadline`` first is a
    ``CollectiveTimeout``.
    """
    if not token:
        _warn_open()
    short = _short(deadline, limit)
    try:
        hello = recv_exact(sock, len(_MAGIC) + _NONCE, short, what, peer)
    except CollectiveTimeout:
        if short >= deadline:
            raise
        reason = (
            f"it accepted the connection but sent nothing for {limit:g} s instead of starting the ferrodist handshake"
        )
        raise NotFerrodist(f"{what}: the process at rank {peer}'s address {reason}", reason=reason) from None
    if hello[:4] != _MAGIC:
        reason = f"it answered with {hello[:12]!r}..., which is not the ferrodist handshake"
        raise NotFerrodist(f"{what}: the process at rank {peer}'s address {reason}", reason=reason)
    nonce = os.urandom(_NONCE)
    sock.sendall(_MAGIC + _mac(token, b"client", hello[4:]) + nonce)
    verdict = recv_exact(sock, 1, short, what, peer)
    if verdict != _ACCEPTED:
        raise AuthenticationFailed(
            f"{what}: rank {peer} refused this process: its FERRODIST_TOKEN is not the job's "
            "(start every rank with the same launcher, or export the same token)"
        )
    proof = recv_exact(sock, 32, short, what, peer)
    if not hmac.compare_digest(proof, _mac(token, b"server", nonce)):
        raise AuthenticationFailed(f"{what}: the process at rank {peer}'s address does not hold this job's token")
