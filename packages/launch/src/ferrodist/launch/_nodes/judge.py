"""The verdict on a job of several nodes: its nodes, and which rank or node the whole job
blames, the same on every node (see ``_nodes``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ferrodist.launch._verdict import RankEnd, RankError, diagnose, finished_without, signal_name

__all__ = ["Node", "Outcome", "judge"]


@dataclass(frozen=True)
class Node:
    """One node of the job: its launcher's host and pid, and its ranks ``first .. first + count - 1``."""

    node: int
    host: str
    pid: int
    first: int
    count: int

    def describe(self) -> str:
        ranks = f"rank {self.first}" if self.count == 1 else f"ranks {self.first}-{self.first + self.count - 1}"
        return f"node {self.node} ({self.host}, {ranks})"


@dataclass(frozen=True)
class Outcome:
    """The verdict on the whole job, the same on every node."""

    exit_code: int
    failed_rank: int | None
    failed_node: int | None
    summary: str


def judge(
    nodes: Sequence[Node],
    reports: dict[int, dict[str, object]],
    lost: dict[int, str],
    interrupted: tuple[int, int] | None,
) -> Outcome:
    """The verdict on a job of several nodes, from each node's report of how its ranks ended.

    A node's ranks are ordered by when they exited (seconds since their node started them),
    which orders the whole job's exits for ``diagnose``. An interrupted launcher comes first
    (no rank is to blame), then a lost node (its ranks' fate is unknown), then ``diagnose``'s
    rules over every rank, with the node of the rank it blames. The ranks a node's report
    says the job went on without (an elastic job's failures it tolerated) are not blamed.
    """
    rows = []
    for node, report in reports.items():
        for row in report.get("ends", ()):  # type: ignore[attr-defined]
            at = row.get("at")
            rows.append((at if isinstance(at, (int, float)) else float("inf"), node, row["seen"], row))
    rows.sort(key=lambda r: r[:3])
    ends = []
    for seen, (_, _, _, row) in enumerate(rows):
        error = row.get("error")
        ends.append(
            RankEnd(
                int(row["rank"]),
                int(row["code"]),
                seen,
                row.get("stopped"),
                RankError(str(error[0]), tuple(int(r) for r in error[1]), str(error[2])) if error else None,
            )
        )
    by_node = {n.node: n for n in nodes}
    stopped = sorted(e.rank for e in ends if e.stopped is not None)
    if interrupted is not None:
        node, signum = interrupted
        verdict = diagnose(ends, interrupted=signum)
        name = signal_name(signum)
        where = f"{name} on node {node}" + (f" ({by_node[node].host})" if node in by_node else "")
        return Outcome(verdict.exit_code, None, None, verdict.summary.replace(name, where, 1))
    if lost:
        node = next(iter(lost))
        summary = f"ferrodist run: {by_node[node].describe()} was lost: {lost[node]}"
        others = [k for k in lost if k != node]
        if others:
            summary += f"; also lost: nodes {others}"
        if stopped:
            summary += f"; stopped by their launchers: ranks {stopped}"
        return Outcome(1, None, node, summary)
    went_on = {int(r) for report in reports.values() for r in report.get("went_on", ())}  # type: ignore[attr-defined]
    verdict = diagnose([e for e in ends if e.rank not in went_on])
    summary = verdict.summary.replace("stopped by the launcher:", "stopped by their launchers:")
    if not verdict.culprits:
        return Outcome(
            verdict.exit_code, None, None, finished_without(len(ends), sorted(went_on)) if went_on else summary
        )
    home = {r: n for n in nodes for r in range(n.first, n.first + n.count)}
    where = "; ".join(f"rank {r} ran on node {home[r].node} ({home[r].host})" for r in verdict.culprits if r in home)
    culprit = verdict.culprits[0]
    return Outcome(
        verdict.exit_code,
        culprit,
        home[culprit].node if culprit in home else None,
        f"{summary}; {where}" if where else summary,
    )
