"""Node 0's launcher: the server of the control channel (see ``_nodes`` for the protocol)."""

from __future__ import annotations

import collections
import os
import secrets
import select
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict

from ferrodist.launch._nodes.channel import HANDSHAKE, MOST_KNOCKS, Channel, Knock, loopback
from ferrodist.launch._nodes.judge import Node, Outcome, judge
from ferrodist.launch._nodes.link import HEARTBEAT, NodeFailure, NodeLink, Watch, froze, read_signal
from ferrodist.launch._nodes.placement import Placement, place
from ferrodist.launch._nodes.refused import Refused
from ferrodist.launch._verdict import RankEnd, signal_name

__all__ = ["Hub"]


class Hub(NodeLink):
    """Node 0's launcher: the control channel's server."""

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        *,
        nnodes: int,
        nprocs: int,
        token: str,
        silence: float,
        elastic: bool = False,
    ) -> None:
        super().__init__(0, silence)
        self.master_addr, self.master_port, self.nnodes, self.nprocs = master_addr, master_port, nnodes, nprocs
        self.elastic = elastic
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
        watch, late = Watch(), None  # late: how far past the deadline this launcher woke from a freeze
        while len(hosts) < self.nnodes or stopping:
            left = deadline - time.monotonic()
            if stopping and (left <= 0 or len(hosts) == self.nnodes):
                self._abort(*stopping)
            if late is None and not stopping and (late := watch.woke_late(deadline)) is not None:
                # Stopped across the deadline: the nodes that waited in the queue meanwhile may
                # still be there; a handshake's time to finish, and the job goes on.
                deadline = time.monotonic() + HANDSHAKE
                left = HANDSHAKE
            if left <= 0:
                missing = [k for k in range(self.nnodes) if k not in hosts]
                if late is not None:
                    who = f"node {missing[0]}" if len(missing) == 1 else f"nodes {missing}"
                    how = f"it was stopped and woke {late:.0f} s past its join deadline, and {who} had given up on it"
                    self._abort(froze(0, how), 0)
                self._abort(self._never_arrived(missing, sorted(hosts)), missing[0])
            watched = [self._listener.fileno(), stop_fd, *(ch.fileno() for ch in [*pending, *self._members.values()])]
            watched += [knock.fileno() for knock in self._knocks]
            wake = min([left, *(knock.deadline - time.monotonic() for knock in self._knocks)])
            ready = watch.select(watched, max(0.0, wake))
            if stop_fd in ready:
                signum = read_signal(stop_fd)
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
        if bool(hello.get("elastic", False)) != self.elastic:
            kinds = ("-n MIN:MAX (elastic)", "-n N")
            theirs, ours = (kinds[0], kinds[1]) if hello.get("elastic") else (kinds[1], kinds[0])
            self._abort(
                f"ferrodist run: {who} was started with {theirs} but node 0 with {ours}: every node's ranks "
                "must take replacements in at the same points, or none: give every launcher MIN:MAX, or none",
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
        """Read what the members sent; notice members lost or silent; share the join directory."""
        self._send_joins(list(self._members.values()))
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
                    if self._succeeded(message):
                        self._finished(node)
                elif kind == "join" and self.joins is not None and self.joins.apply(message):
                    for other, peer in self._members.items():
                        if other != node and not peer.closed:
                            peer.send("join", **{k: v for k, v in message.items() if k != "kind"})
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

    def _finished(self, node: int) -> None:
        """Node ``node``'s ranks finished: tell the others (their replacements still waiting to
        join have no group left to join)."""
        self.finished.add(node)
        for other, ch in self._members.items():
            if other != node and not ch.closed:
                ch.send("finished", node=node)

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
        self,
        ends: Sequence[RankEnd],
        times: dict[int, float],
        interrupted: int | None,
        stop_fd: int,
        limit: float,
        went_on: Sequence[int] = (),
    ) -> Outcome:
        """Wait (``limit`` s at most) until every member has reported or is lost; send them all
        the verdict on the job and return it."""
        self._reports[0] = self._report(ends, times, interrupted, went_on)
        if self._succeeded(self._reports[0]):
            self._finished(0)
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
                signum = read_signal(stop_fd)
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
