"""The launchers of a job that spans several nodes, and how they keep each other informed.

Node 0's launcher (the *hub*) listens on ``--master-addr:--master-port``; the launcher of
every other node (a *member*) connects to it. Each connection starts with a challenge and
response over ``FERRODIST_TOKEN``, which every node must have (the same value): each side
proves it holds the token without sending it. Then:

1. **Join.** The hub runs every connection's handshake at once, each with its own limit
   (``HANDSHAKE``), so a connection that stays silent or is not a launcher holds up no
   other; a node that never arrives is named with what the hub refused, and from where.
   A member sends ``hello`` (its node rank, ``--nnodes``, ``-n``, host, pid).
   When every node has arrived the hub numbers the ranks node by node, picks the port of
   rank 0's store and a job id, and sends ``start`` with the list of nodes; a node that has
   not arrived by ``--join-timeout`` fails the job on every node that did, naming it.
   Conflicting starts (two launchers as one node, a different ``--nnodes``) end the job on
   every node that arrived, saying which.
2. **Run.** Every launcher sends a heartbeat every 0.5 s. A launcher whose ranks fail (or
   that is interrupted) tells the hub, which tells every node to stop its ranks. A member
   whose connection ends before it has reported, or that is silent for ``silence`` seconds,
   is lost: the hub stops every other node. A member that loses the hub stops its ranks.
3. **Verdict.** Every member sends how its ranks ended (``ends``); the hub blames one rank
   or node for the whole job (``judge``) and sends that ``verdict`` to every member, so
   every launcher prints the same summary and exits with the same code.

The ranks' own token is derived from ``FERRODIST_TOKEN`` and the job id (HMAC-SHA256), so
two jobs started with one exported token never accept each other's connections, and no
secret travels on the control channel.
"""

from __future__ import annotations

import collections
import hmac
import os
import secrets
import select
import signal
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict

from ._channel import (
    ACCEPT,
    HANDSHAKE,
    MAGIC,
    MOST_KNOCKS,
    NONCE,
    Channel,
    Knock,
    loopback,
    proof,
    recv_exact,
)
from ._judge import Node, Outcome, judge
from ._placement import Placement, place
from ._refused import Refused
from ._verdict import RankEnd, diagnose, signal_name

__all__ = [
    "DEFAULT_JOIN_TIMEOUT",
    "DEFAULT_SILENCE",
    "Hub",
    "Member",
    "NodeFailure",
    "Placement",
]

#: Seconds node 0's launcher waits for the other nodes' launchers (``--join-timeout``).
DEFAULT_JOIN_TIMEOUT = 300.0
#: Seconds of silence after which a launcher counts another as lost.
DEFAULT_SILENCE = 5.0
HEARTBEAT = 0.5


class NodeFailure(Exception):
    """The job could not start, or a node was lost: ``summary`` is the line to print."""

    def __init__(self, summary: str, *, node: int | None = None, exit_code: int = 1) -> None:
        super().__init__(summary)
        self.summary = summary
        self.node = node
        self.exit_code = exit_code


class _Link:
    """What a launcher's supervisor needs from the other nodes, hub or member."""

    def __init__(self, node: int, silence: float) -> None:
        self.node = node
        self.silence = silence
        self.remote_stop: str | None = None  # why another node's state means: stop our ranks
        self._beating = threading.Event()
        self._beater: threading.Thread | None = None

    def _channels(self) -> list[Channel]:
        raise NotImplementedError

    def fds(self) -> list[int]:
        return [ch.fileno() for ch in self._channels() if not ch.closed]

    def start_heartbeats(self) -> None:
        """Heartbeats from a thread of their own (call it after the ranks were forked)."""
        self._beater = threading.Thread(target=self._beat, name="ferrodist-heartbeat", daemon=True)
        self._beater.start()

    def _beat(self) -> None:
        while not self._beating.wait(HEARTBEAT):
            for ch in self._channels():
                if not ch.closed:
                    ch.send("hb")

    def close(self) -> None:
        self._beating.set()
        if self._beater is not None:
            self._beater.join(5)
        for ch in self._channels():
            ch.close()

    @staticmethod
    def _report(ends: Sequence[RankEnd], times: dict[int, float], interrupted: int | None) -> dict[str, object]:
        rows = [
            {
                "rank": e.rank,
                "code": e.code,
                "seen": e.seen,
                "at": times.get(e.rank),
                "stopped": e.stopped,
                "error": None if e.error is None else [e.error.name, list(e.error.blames), e.error.message],
            }
            for e in ends
        ]
        return {"ends": rows, "interrupted": interrupted}


class Hub(_Link):
    """Node 0's launcher: the control channel's server."""

    def __init__(
        self, master_addr: str, master_port: int, *, nnodes: int, nprocs: int, token: str, silence: float
    ) -> None:
        super().__init__(0, silence)
        self.master_addr, self.master_port, self.nnodes, self.nprocs = master_addr, master_port, nnodes, nprocs
        self._token = token.encode()
        self._members: dict[int, Channel] = {}
        self._reports: dict[int, dict[str, object]] = {}
        self._lost: dict[int, str] = {}
        self._interrupted: tuple[int, int] | None = None  # (node, signal)
        self._stopping = False
        self._knocks: list[Knock] = []
        self._refused = Refused()
        self.nodes: tuple[Node, ...] = ()
        bind = "127.0.0.1" if loopback(master_addr) else "0.0.0.0"
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((bind, master_port))
        except OSError as exc:
            self._listener.close()
            raise NodeFailure(
                f"ferrodist run: node 0 cannot listen on {bind}:{master_port} for the other nodes' launchers "
                f"({exc.strerror}); choose another --master-port on every node"
            ) from None
        self._listener.listen(64)

    def _channels(self) -> list[Channel]:
        return list(self._members.values())

    # -- join ------------------------------------------------------------------------------------
    def gather(self, deadline: float, stop_fd: int, attempt: int = 0) -> Placement:
        """Wait for every node's launcher (until ``deadline``), then start the job: pick the
        port of rank 0's store and the job id, and tell every member; returns the placement of
        node 0's ranks.

        Raises:
            NodeFailure: a node did not arrive by ``deadline``, two launchers claimed one node,
                or the nodes disagree on ``--nnodes`` (the members that arrived are told).
        """
        self._waited = max(0.0, deadline - time.monotonic())
        hosts: dict[int, tuple[str, int, int]] = {0: (socket.gethostname(), os.getpid(), self.nprocs)}
        pending: list[Channel] = []
        stopping: tuple[str, None, int] | None = None  # interrupted in a restart: tell the nodes coming back
        while len(hosts) < self.nnodes or stopping:
            left = deadline - time.monotonic()
            if stopping and (left <= 0 or len(hosts) == self.nnodes):
                self._abort(*stopping)
            if left <= 0:
                missing = [k for k in range(self.nnodes) if k not in hosts]
                self._abort(self._never_arrived(missing, sorted(hosts)), missing[0])
            watched = [self._listener.fileno(), stop_fd, *(ch.fileno() for ch in [*pending, *self._members.values()])]
            watched += [knock.fileno() for knock in self._knocks]
            wake = min([left, *(knock.deadline - time.monotonic() for knock in self._knocks)])
            ready = select.select(watched, [], [], max(0.0, wake))[0]
            if stop_fd in ready:
                signum = _read_signal(stop_fd)
                why = (
                    f"ferrodist run: node 0's launcher was interrupted by {signal_name(signum)} before the job started"
                )
                if stopping or not attempt:
                    self._abort(why, None, 128 + signum)
                stopping, deadline = (why, None, 128 + signum), min(deadline, time.monotonic() + self.silence)
            if self._listener.fileno() in ready:
                self._accept()
            pending += self._handshakes(ready)
            for ch in [*pending, *self._members.values()]:
                if ch.fileno() not in ready:
                    continue
                for message in ch.receive():
                    if message.get("kind") == "hello" and ch in pending:
                        pending.remove(ch)
                        self._welcome(ch, message, hosts)
                if ch.closed:
                    if ch in pending:
                        pending.remove(ch)
                    elif self._members.get(ch.node) is ch:
                        del self._members[ch.node]  # left before the start: it may come again
                        del hosts[ch.node]
                    ch.close()
        taken = ", ".join(f"node {k}: {host} pid {pid}" for k, (host, pid, _) in sorted(hosts.items()))
        for ch in pending:  # launchers that came after every node had arrived
            ch.send(
                "abort",
                why=f"ferrodist run: node 0 started its job without this launcher: all "
                f"{self.nnodes} nodes had arrived ({taken}); is this launcher's --node-rank taken?",
            )
            ch.close()
        self._listener.close()
        for knock in self._knocks:
            knock.sock.close()
        self._knocks = []
        unsaid = self._refused.unsaid()
        if unsaid is not None:
            print(unsaid, flush=True)
        job = secrets.token_hex(6)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1" if loopback(self.master_addr) else "0.0.0.0", 0))
            ranks_port = int(probe.getsockname()[1])
        nodes, first = [], 0
        for k in range(self.nnodes):
            host, pid, count = hosts[k]
            nodes.append(Node(k, host, pid, first, count))
            first += count
        self.nodes = tuple(nodes)
        start = {"job": job, "master_port": ranks_port, "nodes": [asdict(n) for n in nodes], "attempt": attempt}
        for ch in self._members.values():
            ch.send("start", **start)
        return place(self.nodes, 0, self.master_addr, ranks_port, self._token.decode(), job, attempt)

    def _never_arrived(self, missing: list[int], arrived: list[int]) -> str:
        who = f"node {missing[0]}" if len(missing) == 1 else f"nodes {missing}"
        refused = f"; meanwhile node 0 refused {self._refused.tally()}" if self._refused.counts else ""
        if self._knocks:
            hosts = collections.Counter(knock.host for knock in self._knocks)
            by = ", ".join(f"{count} from {host}" for host, count in sorted(hosts.items()))
            refused += f"; {len(self._knocks)} still in their handshake ({by})"
        return (
            f"ferrodist run: {who} never arrived within {round(self._waited, 1):g} s (arrived: nodes {arrived}){refused}: "
            f"start `ferrodist run --nnodes {self.nnodes} --node-rank K --master-addr {self.master_addr} --master-port "
            f"{self.master_port} ...` on each missing node, with the same FERRODIST_TOKEN, or raise --join-timeout"
        )

    def _accept(self) -> None:
        """Take a connection and send it the challenge; its reply is read by ``_handshakes``."""
        try:
            sock, address = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        try:
            self._knocks.append(Knock(sock, address[0]))
        except OSError as exc:
            sock.close()
            self._refuse(address[0], f"it closed the connection during the handshake ({exc.strerror})")
        if len(self._knocks) > MOST_KNOCKS:  # the oldest is a stranger's: the nodes' finish in milliseconds
            oldest = self._knocks.pop(0)
            oldest.sock.close()
            self._refuse(oldest.host, "it stayed silent while more connections came")

    def _handshakes(self, ready: list[int]) -> list[Channel]:
        """Go on with the handshakes that can (``ready``: readable descriptors): the
        connections that proved they hold the token, as channels. A connection that fails
        its handshake, or has not finished it at its own deadline, is refused."""
        joined, now = [], time.monotonic()
        for knock in list(self._knocks):
            why = None
            try:
                if knock.fileno() in ready and knock.read():
                    self._knocks.remove(knock)
                    if knock.answer(self._token):
                        joined.append(Channel(knock.sock, -1))
                        continue
                    why = "it does not hold this job's FERRODIST_TOKEN"
                elif now >= knock.deadline:
                    self._knocks.remove(knock)
                    why = f"it did not finish the handshake within {HANDSHAKE:g} s"
                else:
                    continue
            except OSError as exc:
                if knock in self._knocks:
                    self._knocks.remove(knock)
                why = str(exc)
            knock.sock.close()
            self._refuse(knock.host, why)
        return joined

    def _refuse(self, host: str, why: str) -> None:
        line = self._refused.add(host, why)
        if line is not None:
            print(line, flush=True)

    def _welcome(self, ch: Channel, hello: dict[str, object], hosts: dict[int, tuple[str, int, int]]) -> None:
        try:
            node, nnodes, count = int(hello["node"]), int(hello["nnodes"]), int(hello["nprocs"])  # type: ignore[call-overload]
            host, pid = str(hello["host"]), int(hello["pid"])  # type: ignore[call-overload]
        except (KeyError, TypeError, ValueError):
            ch.close()
            return
        ch.node = node
        who = f"node {node} ({host}, pid {pid})"
        if nnodes != self.nnodes:
            self._abort(
                f"ferrodist run: {who} was started with --nnodes {nnodes} but node 0 with --nnodes {self.nnodes}: "
                "give every launcher the same --nnodes",
                node,
                extra=ch,
            )
        if not 0 < node < self.nnodes or node in hosts:
            if node in hosts:
                other = f"{hosts[node][0]}, pid {hosts[node][1]}"
                why = f"two launchers were started as node {node} ({other} and {host}, pid {pid})"
            else:
                why = f"{who} is not a node of a job of --nnodes {self.nnodes}"
            self._abort(f"ferrodist run: {why}: give each node's launcher its own --node-rank", node, extra=ch)
        hosts[node] = (host, pid, count)
        self._members[node] = ch

    def _abort(self, summary: str, node: int | None, exit_code: int = 1, *, extra: Channel | None = None) -> None:
        for ch in [*self._members.values(), *([extra] if extra is not None else [])]:
            ch.send("abort", why=summary, code=exit_code)
        raise NodeFailure(summary, node=node, exit_code=exit_code)

    # -- run -------------------------------------------------------------------------------------
    def poll(self) -> None:
        """Read what the members sent; notice members lost or silent."""
        now = time.monotonic()
        for node, ch in list(self._members.items()):
            for message in ch.receive():
                kind = message.get("kind")
                if kind == "failed":
                    signum = message.get("interrupted")
                    if isinstance(signum, int) and self._interrupted is None:
                        self._interrupted = (node, signum)
                    self._stop(f"on node {node}, {message.get('why')}", remote=True)
                elif kind == "ends":
                    self._reports[node] = message
            if node in self._reports or node in self._lost:
                continue
            if ch.closed:
                self._lose(node, "its launcher's connection closed (it was killed, or its machine went down)")
            elif now - ch.heard > self.silence:
                self._lose(
                    node,
                    f"its launcher sent nothing for {self.silence:g} s (it is frozen, or the network between the "
                    "nodes is down)",
                )

    def _lose(self, node: int, why: str) -> None:
        self._lost[node] = why
        self._stop(f"{self.nodes[node].describe()} was lost: {why}", remote=True)

    def _stop(self, why: str, *, remote: bool) -> None:
        if remote and self.remote_stop is None:
            self.remote_stop = why
        if not self._stopping:
            self._stopping = True
            for ch in self._members.values():
                if not ch.closed:
                    ch.send("stop", why=why)

    def report(self, why: str, interrupted: int | None = None) -> None:
        """Node 0's own ranks failed, or its launcher was interrupted: stop every node."""
        if interrupted is not None and self._interrupted is None:
            self._interrupted = (0, interrupted)
        self._stop(f"on node 0, {why}", remote=False)

    def finish(
        self, ends: Sequence[RankEnd], times: dict[int, float], interrupted: int | None, stop_fd: int, limit: float
    ) -> Outcome:
        """Wait (``limit`` s at most) until every member has reported or is lost; send them all
        the verdict on the job and return it."""
        self._reports[0] = self._report(ends, times, interrupted)
        give_up = time.monotonic() + limit
        while True:
            self.poll()
            waiting = [k for k in range(1, self.nnodes) if k not in self._reports and k not in self._lost]
            left = give_up - time.monotonic()
            if not waiting:
                break
            if left <= 0:
                for k in waiting:
                    self._lost[k] = f"its launcher did not report how its ranks ended within {limit:g} s"
                break
            live = [self._members[k].fileno() for k in waiting if not self._members[k].closed]
            if stop_fd in select.select([stop_fd, *live], [], [], min(left, HEARTBEAT))[0]:
                signum = _read_signal(stop_fd)
                for k in waiting:
                    self._lost[k] = f"node 0's launcher stopped waiting for it ({signal_name(signum)})"
                break
        outcome = judge(self.nodes, self._reports, self._lost, self._interrupted)
        for ch in self._members.values():
            if not ch.closed:
                ch.send("verdict", **asdict(outcome))
        return outcome

    def close(self) -> None:
        super().close()
        self._listener.close()


class Member(_Link):
    """The launcher of node 1, 2, ...: a client of node 0's."""

    def __init__(self, node: int, *, nnodes: int, nprocs: int, token: str, silence: float) -> None:
        super().__init__(node, silence)
        self.nnodes, self.nprocs = nnodes, nprocs
        self._token = token.encode()
        self._hub: Channel | None = None
        self._hub_lost = False
        self._lost_why = ""
        self._verdict: dict[str, object] | None = None

    def _channels(self) -> list[Channel]:
        return [self._hub] if self._hub is not None else []

    def join(self, master_addr: str, master_port: int, deadline: float, stop_fd: int) -> Placement:
        """Reach node 0's launcher (retrying until ``deadline``), say who this node is, and
        wait for the start (node 0 waits for the other nodes up to its own deadline).

        Raises:
            NodeFailure: node 0 could not be reached, refused this node, or ended the job
                before it started (its reason).
        """
        where = f"node 0's launcher at {master_addr}:{master_port}"
        last = "nothing answered"
        while self._hub is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NodeFailure(
                    f"ferrodist run: node {self.node} could not reach {where} ({last}): start node 0's launcher, "
                    "and give every node the same --master-addr (node 0's address) and --master-port",
                    node=0,
                )
            if stop_fd in select.select([stop_fd], [], [], 0)[0]:
                raise NodeFailure(
                    f"ferrodist run: node {self.node}'s launcher was interrupted before the job started",
                    exit_code=128 + _read_signal(stop_fd),
                )
            try:
                sock = socket.create_connection((master_addr, master_port), timeout=min(left, HANDSHAKE))
            except OSError as exc:
                last = exc.strerror or str(exc)
                time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
                continue
            self._hub = Channel(self._handshake(sock, where), 0)
        self._hub.send(
            "hello",
            node=self.node,
            nnodes=self.nnodes,
            nprocs=self.nprocs,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NodeFailure(f"ferrodist run: {where} did not start the job by the join deadline", node=0)
            ready = select.select([self._hub.fileno(), stop_fd], [], [], left)[0]
            if stop_fd in ready:
                raise NodeFailure(
                    f"ferrodist run: node {self.node}'s launcher was interrupted before the job started",
                    exit_code=128 + _read_signal(stop_fd),
                )
            for message in self._hub.receive():
                if message.get("kind") == "abort":  # with node 0's exit code: one verdict on every node
                    raise NodeFailure(str(message.get("why")), exit_code=int(message.get("code", 1)))  # type: ignore[call-overload]
                if message.get("kind") == "start":
                    nodes = tuple(Node(**n) for n in message["nodes"])  # type: ignore[attr-defined]
                    job, port = str(message["job"]), int(message["master_port"])  # type: ignore[call-overload]
                    attempt = int(message.get("attempt", 0))  # type: ignore[call-overload]
                    return place(nodes, self.node, master_addr, port, self._token.decode(), job, attempt)
            if self._hub.closed:
                raise NodeFailure(
                    f"ferrodist run: {where} closed the connection before the job started (see its output)", node=0
                )

    def _handshake(self, sock: socket.socket, where: str) -> socket.socket:
        try:
            sock.settimeout(HANDSHAKE)
            hello = recv_exact(sock, len(MAGIC) + NONCE)
            if hello[:4] != MAGIC:
                raise NodeFailure(
                    f"ferrodist run: the program at {where} is not a ferrodist launcher; check "
                    "--master-addr and --master-port"
                )
            nonce = os.urandom(NONCE)
            sock.sendall(MAGIC + proof(self._token, b"member", hello[4:]) + nonce)
            if recv_exact(sock, 1) != ACCEPT:
                raise NodeFailure(
                    f"ferrodist run: {where} refused node {self.node}: its FERRODIST_TOKEN is not node 0's; export "
                    "the same FERRODIST_TOKEN on every node"
                )
            if not hmac.compare_digest(recv_exact(sock, 32), proof(self._token, b"hub", nonce)):
                raise NodeFailure(f"ferrodist run: the launcher at {where} does not hold this job's FERRODIST_TOKEN")
        except OSError as exc:
            sock.close()
            raise NodeFailure(
                f"ferrodist run: the handshake with {where} failed ({exc}): it closed the connection or did not "
                "answer; if it is running, its job may have started without this node (is another launcher "
                f"running as node {self.node}?)",
                node=0,
            ) from None
        except NodeFailure:
            sock.close()
            raise
        return sock

    def poll(self) -> None:
        hub = self._hub
        if hub is None or self._hub_lost:
            return
        for message in hub.receive():
            kind = message.get("kind")
            if kind == "stop" and self.remote_stop is None:
                self.remote_stop = str(message.get("why"))
            elif kind == "verdict":
                self._verdict = message
        if self._verdict is not None:
            return
        if hub.closed:
            self._lose("its connection closed (it was killed, or its machine went down)")
        elif time.monotonic() - hub.heard > self.silence:
            self._lose(f"it sent nothing for {self.silence:g} s (it is frozen, or the network is down)")

    def _lose(self, why: str) -> None:
        self._hub_lost = True
        self._lost_why = why
        if self.remote_stop is None:
            self.remote_stop = f"node 0's launcher was lost: {why}"

    def report(self, why: str, interrupted: int | None = None) -> None:
        if self._hub is not None and not self._hub_lost:
            self._hub.send("failed", why=why, interrupted=interrupted)

    def finish(
        self, ends: Sequence[RankEnd], times: dict[int, float], interrupted: int | None, stop_fd: int, limit: float
    ) -> Outcome:
        """Send how this node's ranks ended and wait (``limit`` s at most) for node 0's verdict.
        Without one (node 0 lost), the verdict on this node's ranks alone, saying so."""
        hub = self._hub
        assert hub is not None
        if not self._hub_lost:
            hub.send("ends", **self._report(ends, times, interrupted))
        give_up = time.monotonic() + limit
        while self._verdict is None and not self._hub_lost:
            left = give_up - time.monotonic()
            if left <= 0:
                self._lose(f"it sent no verdict within {limit:g} s")
                break
            if stop_fd in select.select([stop_fd, hub.fileno()], [], [], min(left, HEARTBEAT))[0]:
                self._lose(f"this launcher stopped waiting for it ({signal_name(_read_signal(stop_fd))})")
                break
            self.poll()
        if self._verdict is not None:
            v = self._verdict
            node = v.get("failed_node")
            rank = v.get("failed_rank")
            return Outcome(
                int(v["exit_code"]),  # type: ignore[call-overload]
                rank if isinstance(rank, int) else None,
                node if isinstance(node, int) else None,
                str(v["summary"]),
            )
        local = diagnose(ends, interrupted=interrupted)
        summary = f"ferrodist run: node {self.node} lost node 0's launcher ({self._lost_why}) and stopped its ranks"
        if local.summary:
            summary += "; on this node: " + local.summary.removeprefix("ferrodist run: ")
        return Outcome(local.exit_code or 1, local.culprits[0] if local.culprits else None, 0, summary)


def _read_signal(fd: int) -> int:
    try:
        data = os.read(fd, 1)
    except BlockingIOError:
        return signal.SIGINT
    return data[0] if data else signal.SIGINT
