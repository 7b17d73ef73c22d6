"""`ferrodist run --nnodes N`: launchers of one job on several nodes, here two or three
launchers on 127.0.0.1 (tests/integration/test_two_hosts.py runs them in two network
namespaces). Numbering node by node, one derived token, the auto backend, teardown of every
node when one fails, a lost or frozen launcher, a node that never arrives, bad starts.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _helpers import free_port

pytest.importorskip("ferrodist.launch", reason="ferrodist-launch is not installed (pip install packages/launch)")
from ferrodist.launch import main
from ferrodist.launch._nodes.channel import HANDSHAKE, rank_token
from ferrodist.launch._nodes.judge import Node, judge
from ferrodist.launch._nodes.refused import NAMED

PLACE = Path(__file__).parents[1] / "integration" / "scripts" / "place.py"
_PLACE_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FERRODIST_TOKEN")


def alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def job(tmp_path: Path, body: str) -> str:
    """A rank script that first writes its pid to ``tmp_path/pid<RANK>``."""
    path = tmp_path / "job.py"
    path.write_text(
        "import os, signal, sys, time\n"
        f"OUT = {str(tmp_path)!r}\n"
        "with open(os.path.join(OUT, 'pid' + os.environ['RANK']), 'w') as f:\n"
        "    f.write(str(os.getpid()))\n" + textwrap.dedent(body)
    )
    return str(path)


def launcher(
    node: int, nnodes: int, port: int, nprocs: int, *command: str, token: str = "nodes-test", options: tuple = ()
) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in _PLACE_VARS and not k.startswith(("OMPI_", "SLURM_"))}
    env["FERRODIST_TOKEN"] = token
    args = ["--nnodes", str(nnodes), "--node-rank", str(node), "--master-port", str(port), "-n", str(nprocs)]
    return subprocess.Popen(
        [sys.executable, "-m", "ferrodist.launch", "run", *args, *options, *command],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(procs: list[subprocess.Popen[str]], limit: float = 60) -> list[str]:
    """Every launcher's output once it exits (``limit`` s at most, then it is killed)."""
    give_up = time.monotonic() + limit
    outputs = []
    for proc in procs:
        try:
            out = proc.communicate(timeout=max(0.1, give_up - time.monotonic()))[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0] + f"\n(killed after {limit} s)"
        outputs.append(out)
    return outputs


def pids(tmp_path: Path, ranks: range, limit: float = 30) -> list[int]:
    """The pids the ranks wrote, once they all have."""
    files = [tmp_path / f"pid{rank}" for rank in ranks]
    give_up = time.monotonic() + limit
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < give_up, "the ranks never started"
        time.sleep(0.02)
    return [int(f.read_text()) for f in files]


def summary(output: str) -> str:
    return [line for line in output.splitlines() if line.startswith("ferrodist run: ")][-1]


def test_ranks_are_numbered_node_by_node_with_one_token_derived_for_the_job(tmp_path):
    script = job(
        tmp_path,
        """
        import hashlib
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                 "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        token = hashlib.sha256(os.environ["FERRODIST_TOKEN"].encode()).hexdigest()[:12]
        print("env", *(os.environ[n] for n in names), token)
        """,
    )
    port = free_port()
    # Node 1 starts first and runs more ranks than node 0: numbering follows the nodes.
    procs = [launcher(1, 2, port, 2, script), launcher(0, 2, port, 1, script)]
    outputs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], outputs
    rows = sorted(line.split()[3:] for out in outputs for line in out.splitlines() if " env " in line)
    assert [row[:7] for row in rows] == [
        ["0", "3", "0", "1", "0", "0", "2"],
        ["1", "3", "0", "2", "1", "1", "2"],
        ["2", "3", "1", "2", "1", "1", "2"],
    ], outputs
    assert len({(row[7], row[8]) for row in rows}) == 1  # one store address for the job
    assert int(rows[0][8]) != port  # the launchers' port is not the ranks' store
    tokens = {row[9] for row in rows}
    assert len(tokens) == 1, "every rank of the job gets one token"
    assert tokens != {hashlib.sha256(b"nodes-test").hexdigest()[:12]}, "the given token is not handed to the ranks"
    assert "[rank 2] env 2 3" in outputs[0] and "[rank 0] env 0 3" in outputs[1]


def test_the_auto_backend_picks_tcp_across_launchers_and_the_job_computes_right(tmp_path):
    port = free_port()
    procs = [launcher(0, 2, port, 2, str(PLACE), "auto"), launcher(1, 2, port, 1, str(PLACE), "auto")]
    outputs = finish(procs, limit=120)
    assert [p.returncode for p in procs] == [0, 0], outputs
    lines = sorted(line for out in outputs for line in out.splitlines() if "] place " in line)
    assert len(lines) == 3, outputs
    for rank, line in enumerate(lines):
        assert f"[rank {rank}] place rank={rank} world=3 " in line
        assert "transport=TcpTransport sum=ok" in line, line
    assert "local_world=2" in lines[0] and "local_world=1" in lines[2]


def test_a_failure_on_node_1_stops_every_node_and_each_launcher_names_it(tmp_path):
    script = job(
        tmp_path,
        """
        if os.environ["RANK"] == "3":
            while not all(os.path.exists(os.path.join(OUT, f"pid{r}")) for r in range(4)):
                time.sleep(0.02)
            sys.exit(7)
        time.sleep(60)
        """,
    )
    port = free_port()
    procs = [launcher(0, 2, port, 2, script), launcher(1, 2, port, 2, script)]
    ranks = pids(tmp_path, range(4))
    start = time.monotonic()
    outputs = finish(procs)
    assert time.monotonic() - start < 15, outputs
    assert [p.returncode for p in procs] == [7, 7], outputs
    expected = (
        "ferrodist run: rank 3 exited with code 7; stopped by their launchers: ranks [0, 1, 2]; rank 3 ran on node 1 ("
    )
    assert summary(outputs[0]).startswith(expected) and summary(outputs[0]) == summary(outputs[1]), outputs
    assert "ferrodist run: node 0 stops its ranks: on node 1, rank 3 exited with code 7" in outputs[0]
    assert not any(alive(pid) for pid in ranks)


def test_a_launcher_killed_stops_the_other_nodes_within_seconds(tmp_path):
    script = job(tmp_path, "time.sleep(60)\n")
    port = free_port()
    procs = [launcher(0, 2, port, 1, script), launcher(1, 2, port, 1, script)]
    ranks = pids(tmp_path, range(2))
    procs[1].kill()
    start = time.monotonic()
    outputs = finish(procs)
    assert time.monotonic() - start < 10, outputs
    assert procs[0].returncode == 1, outputs
    assert summary(outputs[0]).startswith(
        "ferrodist run: node 1 ("
    ) and "rank 1) was lost: its launcher's connection closed" in summary(outputs[0])
    assert "stopped by their launchers: ranks [0]" in summary(outputs[0])
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in ranks), "a rank outlived the job"


def test_a_frozen_launcher_is_lost_after_five_silent_seconds(tmp_path):
    script = job(tmp_path, "time.sleep(60)\n")
    port = free_port()
    procs = [launcher(0, 2, port, 1, script), launcher(1, 2, port, 1, script)]
    pids(tmp_path, range(2))
    os.kill(procs[1].pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        out0 = finish(procs[:1])[0]
        took = time.monotonic() - start
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
    out1 = finish(procs[1:])[0]
    assert 4.5 < took < 12, out0
    assert procs[0].returncode == 1 and "was lost: its launcher sent nothing for 5 s" in summary(out0), out0
    # Once it runs again, the frozen launcher learns it was given up on, and stops its rank.
    assert procs[1].returncode != 0 and "was lost" in summary(out1), out1


def test_a_node_that_never_arrives_fails_every_node_that_did_naming_it(tmp_path):
    script = job(tmp_path, "pass\n")
    port = free_port()
    start = time.monotonic()
    procs = [
        launcher(0, 3, port, 1, script, options=("--join-timeout", "3")),
        launcher(1, 3, port, 1, script),
    ]
    outputs = finish(procs)
    assert time.monotonic() - start < 15
    assert [p.returncode for p in procs] == [1, 1], outputs
    for out in outputs:
        assert "ferrodist run: node 2 never arrived within 3 s (arrived: nodes [0, 1]): start `ferrodist run" in out
        assert "--nnodes 3 --node-rank K --master-addr 127.0.0.1" in out
    assert not list(tmp_path.glob("pid*")), "no rank may start before every node arrived"


def test_a_launcher_with_another_token_is_refused_and_named_missing(tmp_path):
    script = job(tmp_path, "pass\n")
    port = free_port()
    procs = [
        launcher(0, 2, port, 1, script, options=("--join-timeout", "3")),
        launcher(1, 2, port, 1, script, token="another"),
    ]
    outputs = finish(procs)
    assert [p.returncode for p in procs] == [1, 1], outputs
    assert "refused node 1: its FERRODIST_TOKEN is not node 0's; export the same FERRODIST_TOKEN" in outputs[1]
    assert "it does not hold this job's FERRODIST_TOKEN" in outputs[0]
    assert "ferrodist run: node 1 never arrived within 3 s" in outputs[0]


def knock(port: int, talk: bytes | None, limit: float = 30) -> socket.socket:
    """A connection to node 0's launcher from outside the job (retried until it listens):
    silent, or sending ``talk``."""
    give_up = time.monotonic() + limit
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=1)
            break
        except ConnectionRefusedError:
            assert time.monotonic() < give_up, "node 0's launcher never listened"
            time.sleep(0.05)
    if talk is not None:
        sock.sendall(talk)
    return sock


def test_silent_connections_do_not_hold_up_the_nodes_joining(tmp_path):
    """Eight silent connections and one that speaks HTTP reach node 0 before node 1 does:
    each is dropped at its own limit, while node 1 joins at once (one after the other they
    would take 40 s, past the join timeout)."""
    script = job(tmp_path, "pass\n")
    port = free_port()
    hub = launcher(0, 2, port, 1, script, options=("--join-timeout", "4"))
    strangers = [knock(port, None) for _ in range(8)] + [knock(port, b"GET / HTTP/1.0\r\n\r\n")]
    try:
        procs = [hub, launcher(1, 2, port, 1, script)]
        outputs = finish(procs)
    finally:
        for sock in strangers:
            sock.close()
    assert [p.returncode for p in procs] == [0, 0], outputs


def alone_with_strangers(tmp_path: Path, payloads: list[bytes | None], join_timeout: str) -> tuple[int, str]:
    """Node 0's launcher of two nodes, node 1 never started, strangers connecting meanwhile
    (each sending one of ``payloads``; None: nothing): its exit code and output."""
    script = job(tmp_path, "pass\n")
    port = free_port()
    hub = launcher(0, 2, port, 1, script, options=("--join-timeout", join_timeout))
    strangers = [knock(port, payload) for payload in payloads]
    try:
        (out,) = finish([hub])
    finally:
        for sock in strangers:
            sock.close()
    return hub.returncode, out


def test_a_start_that_fails_says_what_node_0_refused_and_from_where(tmp_path):
    code, out = alone_with_strangers(tmp_path, [b"GET / HTTP/1.0\r\n\r\n", b"\x00" * 68, None], "2")
    assert code == 1, out
    assert (
        "ferrodist run: node 1 never arrived within 2 s (arrived: nodes [0]); meanwhile node 0 refused 2 "
        "connections: 2 from 127.0.0.1 (it does not speak the launchers' protocol); 1 still in their handshake "
        "(1 from 127.0.0.1): start `ferrodist run"
    ) in summary(out), out


def test_a_flood_of_strangers_is_named_five_times_then_counted(tmp_path):
    code, out = alone_with_strangers(tmp_path, [b"\x00" * 68] * 12, "4")
    assert code == 1, out
    named = [line for line in out.splitlines() if "node 0 refused a connection from 127.0.0.1" in line]
    assert len(named) == NAMED, out
    assert "(further ones are counted, and said every 10 s)" in named[-1], out
    found = re.search(
        r"meanwhile node 0 refused (\d+) connections: \1 from 127.0.0.1 \(it does not speak", summary(out)
    )
    still = re.search(r"(\d+) still in their handshake", summary(out))
    assert found is not None, out
    assert int(found.group(1)) + (int(still.group(1)) if still else 0) == 12, out


@pytest.mark.parametrize("nnodes", [1, 2])
def test_a_rank_frozen_past_the_deadline_that_resumes_is_the_one_named(tmp_path, nnodes):
    """The last rank is stopped (SIGSTOP) past the others' 1 s deadline and resumed while the
    launchers are still stopping the job: it fails too, with what it read of the others'
    failures, and the verdict names it all the same, on every node."""
    script = job(
        tmp_path,
        """
        import numpy as np
        import ferrodist.collectives as dist
        dist.init_process_group("tcp", timeout=30)
        for i in range(3000):
            dist.all_reduce(np.ones(4), timeout=1.0)
            if i == 20:  # the ranks have run calls together
                open(os.path.join(OUT, "ready" + os.environ["RANK"]), "w").close()
            time.sleep(0.005)
        """,
    )
    port, ranks = free_port(), 4
    procs = [launcher(node, nnodes, port, ranks // nnodes, script, options=("--grace", "5")) for node in range(nnodes)]
    try:
        frozen = pids(tmp_path, range(ranks))[-1]
        give_up = time.monotonic() + 60
        while not all((tmp_path / f"ready{rank}").exists() for rank in range(ranks)):
            assert time.monotonic() < give_up, "the ranks never ran their first calls"
            time.sleep(0.02)
        os.kill(frozen, signal.SIGSTOP)
        time.sleep(2.0)
        os.kill(frozen, signal.SIGCONT)
    finally:
        outputs = finish(procs)
    for out in outputs:
        assert summary(out).startswith(f"ferrodist run: rank {ranks - 1} "), out


def test_an_interrupt_of_node_0_during_a_restart_ends_every_node_at_once_with_one_verdict(tmp_path):
    """Rank 1 (node 1) fails in the first attempt, so both launchers restart the job; node 0's
    launcher gets SIGINT just after it says so, while node 1's is on its way back: both end
    within seconds, exit 130, saying node 0's launcher was interrupted."""
    script = job(
        tmp_path,
        """
        if os.environ["RANK"] == "1" and os.environ["FERRODIST_RESTART_COUNT"] == "0":
            sys.exit(3)
        time.sleep(60)
        """,
    )
    port = free_port()
    options = ("--max-restarts", "1", "--join-timeout", "30")
    procs = [launcher(node, 2, port, 1, script, options=options) for node in range(2)]
    seen = []
    try:
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            seen.append(line)
            if "ferrodist run: restarting the job" in line:
                procs[0].send_signal(signal.SIGINT)
                break
        started = time.monotonic()
    finally:
        outputs = finish(procs, limit=60)
    took = time.monotonic() - started
    outputs[0] = "".join(seen) + outputs[0]
    assert [p.returncode for p in procs] == [130, 130], outputs
    assert took < 15, (took, outputs)  # not node 1's join timeout
    for out in outputs:
        assert "interrupted by SIGINT" in summary(out), out


def listening(port: int) -> bool:
    """True if a socket listens on ``port`` (IPv4, this machine)."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return any(int(row[1].split(":")[1], 16) == port and row[3] == "0A" for row in rows)


def _restart_for_a_lost_node_then_stop_node_0(tmp_path: Path, join_timeout: str):
    """Node 1's launcher is killed in the first attempt; node 0's launcher restarts the job and
    waits for node 1 on a new listener, and is stopped (SIGSTOP) there; a new node 1 launcher
    is started. Returns node 0's launcher (stopped), the new node 1 launcher, node 0's output
    so far and the port."""
    script = job(
        tmp_path,
        """
        if os.environ["FERRODIST_RESTART_COUNT"] == "0":
            time.sleep(60)
        """,
    )
    port = free_port()
    options = ("--max-restarts", "1", "--join-timeout", join_timeout)
    node0, node1 = (launcher(node, 2, port, 1, script, options=options) for node in range(2))
    pids(tmp_path, range(2))
    node1.kill()
    node1.communicate(timeout=30)
    seen = []
    assert node0.stdout is not None
    for line in node0.stdout:
        seen.append(line)
        if "ferrodist run: restarting the job" in line:
            break
    give_up = time.monotonic() + 30
    while not listening(port):
        assert time.monotonic() < give_up, "".join(seen)
        time.sleep(0.01)
    node0.send_signal(signal.SIGSTOP)
    return node0, launcher(1, 2, port, 1, script, options=options), "".join(seen)


def test_node_0_stopped_during_a_restart_for_longer_than_a_handshake_goes_on_when_resumed(tmp_path):
    """Node 0's launcher is stopped while it waits for the other nodes of a restart, and node
    1 connects meanwhile: node 1 waits for node 0's greeting (not a handshake's 5 s), and the
    job goes on when node 0 resumes."""
    node0, node1, seen = _restart_for_a_lost_node_then_stop_node_0(tmp_path, "60")
    try:
        time.sleep(HANDSHAKE + 3)
    finally:
        node0.send_signal(signal.SIGCONT)
    outputs = finish([node0, node1], limit=60)
    assert [node0.returncode, node1.returncode] == [0, 0], [seen + outputs[0], outputs[1]]


def test_node_0_stopped_during_a_restart_past_every_deadline_gets_one_verdict_on_both_nodes(tmp_path):
    """Node 0's launcher stays stopped past node 1's deadline: node 1 ends saying node 0's
    launcher froze, and so does node 0 when it is resumed; both exit 1."""
    node0, node1, seen = _restart_for_a_lost_node_then_stop_node_0(tmp_path, "1")
    try:
        out1 = node1.communicate(timeout=60)[0]
    finally:
        node0.send_signal(signal.SIGCONT)
    out0 = seen + finish([node0], limit=30)[0]
    assert [node0.returncode, node1.returncode] == [1, 1], [out0, out1]
    for out in (out0, out1):
        assert summary(out).startswith("ferrodist run: node 0's launcher froze: "), out
    assert "it accepted node 1's connection and then said nothing for 1" in summary(out1), out1
    assert re.search(r"it was stopped and woke \d+ s past its join deadline, and node 1 had given up", summary(out0))


def test_launchers_that_disagree_on_the_number_of_nodes_both_fail_saying_so(tmp_path):
    script = job(tmp_path, "pass\n")
    port = free_port()
    procs = [launcher(0, 2, port, 1, script), launcher(1, 3, port, 1, script)]
    outputs = finish(procs)
    assert [p.returncode for p in procs] == [1, 1], outputs
    for out in outputs:
        assert "was started with --nnodes 3 but node 0 with --nnodes 2: give every launcher the same --nnodes" in out


def test_sigint_to_one_launcher_stops_every_node(tmp_path):
    script = job(tmp_path, "time.sleep(60)\n")
    port = free_port()
    procs = [launcher(0, 2, port, 1, script), launcher(1, 2, port, 1, script)]
    pids(tmp_path, range(2))
    procs[1].send_signal(signal.SIGINT)
    outputs = finish(procs)
    assert [p.returncode for p in procs] == [128 + signal.SIGINT] * 2, outputs
    for out in outputs:
        assert summary(out).startswith("ferrodist run: interrupted by SIGINT on node 1 ("), out
        assert "passed on to ranks [0, 1]" in summary(out)


def test_a_job_of_several_nodes_needs_a_token_and_says_how_to_make_one(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FERRODIST_TOKEN", raising=False)
    assert main(["run", "--nnodes", "2", "--node-rank", "1", "-n", "1", str(tmp_path / "x.py")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ferrodist run: a job of 2 nodes needs the same FERRODIST_TOKEN on every node")
    assert "export FERRODIST_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(32))')" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is not a node of a job of --nnodes 2"),
        (["--nnodes", "0"], "--nnodes must be at least 1"),
        (["--nnodes", "2", "--join-timeout", "0"], "--join-timeout must be a number of seconds > 0"),
    ],
)
def test_bad_node_arguments_are_named(tmp_path, capsys, args, message):
    assert main(["run", *args, "-n", "1", str(tmp_path / "x.py")]) == 2
    assert message in capsys.readouterr().err


def test_the_ranks_token_differs_per_job_and_from_the_nodes_token():
    assert rank_token("secret", "job1") != rank_token("secret", "job2")
    assert rank_token("secret", "job1") != rank_token("other", "job1")
    assert "secret" not in rank_token("secret", "job1") and len(rank_token("secret", "job1")) == 64


NODES = (Node(0, "a", 10, 0, 2), Node(1, "b", 11, 2, 2))


def ends(node_report: list[tuple[int, int, float, int | None, list | None]]) -> dict:
    return {
        "ends": [
            {"rank": r, "code": c, "seen": i, "at": at, "stopped": s, "error": e}
            for i, (r, c, at, s, e) in enumerate(node_report)
        ]
    }


def test_judge_orders_the_exits_of_every_node_by_time():
    # Rank 0 (node 0) reports losing rank 3 (node 1) after rank 3 was killed; rank 2 was stopped.
    reports = {
        0: ends([(0, 1, 0.9, None, ["PeerLost", [3], "lost rank 3"]), (1, -15, 1.0, 15, None)]),
        1: ends([(3, -9, 0.5, None, None), (2, -15, 1.0, 15, None)]),
    }
    outcome = judge(NODES, reports, {}, None)
    assert (outcome.exit_code, outcome.failed_rank, outcome.failed_node) == (128 + 9, 3, 1)
    assert outcome.summary == (
        "ferrodist run: rank 3 was killed by SIGKILL; failed because of it: ranks [0]; "
        "stopped by their launchers: ranks [1, 2]; rank 3 ran on node 1 (b)"
    )


def test_judge_blames_a_lost_node_before_any_rank():
    reports = {0: ends([(0, 1, 2.0, None, ["PeerLost", [2], "lost rank 2"]), (1, -15, 2.1, 15, None)])}
    outcome = judge(NODES, reports, {1: "its launcher's connection closed"}, None)
    assert (outcome.exit_code, outcome.failed_rank, outcome.failed_node) == (1, None, 1)
    assert outcome.summary == (
        "ferrodist run: node 1 (b, ranks 2-3) was lost: its launcher's connection closed; "
        "stopped by their launchers: ranks [1]"
    )


def test_judge_says_which_node_was_interrupted_and_blames_no_rank():
    reports = {
        0: ends([(0, -15, 0.2, 15, None), (1, -15, 0.2, 15, None)]),
        1: ends([(2, -2, 0.1, 2, None), (3, -9, 3.1, 2, None)]),
    }
    outcome = judge(NODES, reports, {}, (1, signal.SIGINT))
    assert (outcome.exit_code, outcome.failed_rank) == (130, None)
    assert outcome.summary == (
        "ferrodist run: interrupted by SIGINT on node 1 (b), passed on to ranks [0, 1, 2, 3] "
        "(ranks [3] did not stop and got SIGKILL)"
    )
