"""The launcher of node 1, 2, ...: a client of node 0's (see ``_nodes`` for the protocol)."""

from __future__ import annotations

import hmac
import os
import select
import socket
import time
from collections.abc import Sequence
from typing import NoReturn

from ferrodist.launch._nodes.channel import ACCEPT, HANDSHAKE, MAGIC, NONCE, Channel, proof, recv_exact
from ferrodist.launch._nodes.judge import Node, Outcome
from ferrodist.launch._nodes.link import HEARTBEAT, NodeFailure, NodeLink, Watch, froze, read_signal
from ferrodist.launch._nodes.placement import Placement, place
from ferrodist.launch._verdict import RankEnd, diagnose, signal_name

__all__ = ["Member"]


class Member(NodeLink):
    """The launcher of node 1, 2, ...: a client of node 0's."""

    def __init__(
        self, node: int, *, nnodes: int, nprocs: int, token: str, silence: float, elastic: bool = False
    ) -> None:
        super().__init__(node, silence)
        self.nnodes, self.nprocs, self.elastic = nnodes, nprocs, elastic
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
            NodeFailure: node 0 could not be reached, refused this node, froze, or ended the
                job before it started (its reason); this launcher was interrupted or froze.
        """
        where = f"node 0's launcher at {master_addr}:{master_port}"
        last, watch, since = "nothing answered", Watch(), time.monotonic()
        while self._hub is None:
            left = deadline - time.monotonic()
            if left <= 0:
                late = watch.woke_late(deadline)
                if late is not None:
                    self._froze(late, "before it reached node 0's launcher")
                raise NodeFailure(
                    f"ferrodist run: node {self.node} could not reach {where} ({last}): start node 0's launcher, "
                    "and give every node the same --master-addr (node 0's address) and --master-port",
                    node=0,
                )
            if stop_fd in select.select([stop_fd], [], [], 0)[0]:
                self._interrupted(stop_fd)
            try:
                sock = socket.create_connection((master_addr, master_port), timeout=min(left, HANDSHAKE))
            except OSError as exc:
                last = exc.strerror or str(exc)
                if stop_fd in watch.select([stop_fd], min(0.25, max(0.0, deadline - time.monotonic()))):
                    self._interrupted(stop_fd)
                continue
            hub = self._handshake(sock, where, deadline, stop_fd, watch)
            self._hub = None if hub is None else Channel(hub, 0)
        self._hub.send(
            "hello",
            node=self.node,
            nnodes=self.nnodes,
            nprocs=self.nprocs,
            elastic=self.elastic,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        while True:
            ready = watch.select([self._hub.fileno(), stop_fd], max(0.0, deadline - time.monotonic()))
            if stop_fd in ready:
                self._interrupted(stop_fd)
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
            if time.monotonic() >= deadline:
                late = watch.woke_late(deadline)
                if late is not None:
                    self._froze(late, "before node 0 started the job")
                raise NodeFailure(
                    froze(
                        0,
                        f"it took node {self.node}'s hello and then said nothing for {time.monotonic() - since:.0f} s, "
                        "past its own join deadline (it was stopped, or its machine froze)",
                    ),
                    node=0,
                )

    def _froze(self, late: float, when: str) -> NoReturn:
        """This launcher was stopped across its join deadline: say so, naming this node."""
        raise NodeFailure(
            froze(self.node, f"it was stopped and woke {late:.0f} s past its join deadline, {when}"), node=self.node
        )

    def _interrupted(self, stop_fd: int) -> NoReturn:
        raise NodeFailure(
            f"ferrodist run: node {self.node}'s launcher was interrupted before the job started",
            exit_code=128 + read_signal(stop_fd),
        )

    def _handshake(
        self, sock: socket.socket, where: str, deadline: float, stop_fd: int, watch: Watch
    ) -> socket.socket | None:
        """Prove the token to node 0's launcher and check its proof. Its greeting is waited
        for until ``deadline``: a launcher stopped for a while answers when it resumes. None:
        this launcher was stopped meanwhile and node 0 gave up on the connection (try again)."""
        since = time.monotonic()
        try:
            ready = watch.select([sock.fileno(), stop_fd], max(0.0, deadline - since))
            if stop_fd in ready:
                sock.close()
                self._interrupted(stop_fd)
            if not ready:
                sock.close()
                raise NodeFailure(
                    froze(
                        0,
                        f"it accepted node {self.node}'s connection and then said nothing for "
                        f"{time.monotonic() - since:.0f} s (it was stopped, or its machine froze)",
                    ),
                    node=0,
                )
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
            if watch.overran:  # stopped past node 0's handshake limit: it closed this connection
                late = watch.woke_late(deadline)
                if late is not None:
                    self._froze(late, "in its handshake with node 0's launcher")
                return None
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
        self._send_joins([hub])
        for message in hub.receive():
            kind = message.get("kind")
            if kind == "stop" and self.remote_stop is None:
                self.remote_stop = str(message.get("why"))
            elif kind == "verdict":
                self._verdict = message
            elif kind == "join" and self.joins is not None:
                self.joins.apply(message)
            elif kind == "finished" and isinstance(message.get("node"), int):
                self.finished.add(int(message["node"]))  # type: ignore[call-overload]
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
        self,
        ends: Sequence[RankEnd],
        times: dict[int, float],
        interrupted: int | None,
        stop_fd: int,
        limit: float,
        went_on: Sequence[int] = (),
    ) -> Outcome:
        """Send how this node's ranks ended and wait (``limit`` s at most) for node 0's verdict.
        Without one (node 0 lost), the verdict on this node's ranks alone, saying so."""
        hub = self._hub
        assert hub is not None
        if not self._hub_lost:
            hub.send("ends", **self._report(ends, times, interrupted, went_on))
        give_up = time.monotonic() + limit
        while self._verdict is None and not self._hub_lost:
            left = give_up - time.monotonic()
            if left <= 0:
                self._lose(f"it sent no verdict within {limit:g} s")
                break
            if stop_fd in select.select([stop_fd, hub.fileno()], [], [], min(left, HEARTBEAT))[0]:
                self._lose(f"this launcher stopped waiting for it ({signal_name(read_signal(stop_fd))})")
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
