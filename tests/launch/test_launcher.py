"""`ferrodist run`: environment, labelled output, failure propagation, signals, errors."""

from __future__ import annotations

import io
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ferrodist.core import InvalidArgument

pytest.importorskip("ferrodist.launch", reason="ferrodist-launch is not installed (pip install packages/launch)")
from ferrodist.launch import main, run


def script(tmp_path, body: str):
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


@pytest.mark.parametrize(
    ("nprocs", "given", "expected", "said"),
    [(2, None, "1", True), (3, "2", "2", False), (1, None, "unset", False)],
)
def test_several_ranks_get_one_openmp_thread_each_unless_told(
    tmp_path, monkeypatch, capsys, nprocs, given, expected, said
):
    """As torchrun does: ranks that share a host's cores get OMP_NUM_THREADS=1 (torch's and
    BLAS's thread pools would otherwise fight over the cores), said once on stderr; a value
    the user set is kept, and a single rank keeps the default."""
    if given is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", given)
    job = script(tmp_path, "import os; print(os.environ.get('OMP_NUM_THREADS', 'unset'))")
    out = io.BytesIO()
    assert run(nprocs, [job], out=out).exit_code == 0
    assert sorted(out.getvalue().decode().split()[2::3]) == [expected] * nprocs
    note = [line for line in capsys.readouterr().err.splitlines() if "OMP_NUM_THREADS" in line]
    assert note == (
        [
            f"ferrodist run: OMP_NUM_THREADS=1 for each of the {nprocs} ranks on this host (their thread "
            "pools would otherwise share the cores); set OMP_NUM_THREADS to choose another number"
        ]
        if said
        else []
    )


def test_each_rank_gets_its_place_in_the_job_and_a_shared_secret(tmp_path):
    job = script(
        tmp_path,
        """
        import hashlib, os
        token = os.environ["FERRODIST_TOKEN"]
        print(os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"],
              os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], hashlib.sha256(token.encode()).hexdigest()[:8],
              len(token))
        """,
    )
    out = io.BytesIO()
    result = run(3, [job], out=out)
    assert result.exit_code == 0 and result.failed_rank is None and result.returncodes == (0, 0, 0)
    lines = sorted(out.getvalue().decode().splitlines())
    assert [line.split()[:4] for line in lines] == [
        ["[rank", "0]", "0", "3"],
        ["[rank", "1]", "1", "3"],
        ["[rank", "2]", "2", "3"],
    ]
    assert len({line.split()[-2] for line in lines}) == 1  # one token for the job
    assert all(line.split()[-1] == "64" for line in lines)
    assert len({line.split()[6] for line in lines}) == 1  # one master port


def test_the_first_failure_stops_the_others_and_is_named(tmp_path):
    job = script(
        tmp_path,
        """
        import os, sys, time
        if os.environ["RANK"] == "2":
            time.sleep(0.2)
            sys.exit(7)
        time.sleep(60)
        """,
    )
    out = io.BytesIO()
    start = time.monotonic()
    result = run(3, [job], out=out, grace=2)
    assert time.monotonic() - start < 10
    assert result.exit_code == 7 and result.failed_rank == 2
    assert result.returncodes[0] == result.returncodes[1] == -signal.SIGTERM
    assert result.stopped == (0, 1)
    assert "ferrodist run: rank 2 exited with code 7; stopped by the launcher: ranks [0, 1]" in out.getvalue().decode()


def test_a_rank_that_crashes_prints_where_each_thread_was(tmp_path):
    job = script(
        tmp_path,
        """
        import ctypes, os, threading, time
        def helper_thread_waits_here():
            time.sleep(60)
        threading.Thread(target=helper_thread_waits_here, daemon=True).start()
        if os.environ["RANK"] == "1":
            time.sleep(0.2)
            ctypes.string_at(0)  # a read of address 0: SIGSEGV
        time.sleep(60)
        """,
    )
    out = io.BytesIO()
    result = run(2, [job], out=out, grace=2)
    text = out.getvalue().decode()
    assert result.failed_rank == 1 and result.returncodes[1] == -signal.SIGSEGV, text
    assert "[rank 1] Fatal Python error: Segmentation fault" in text, text
    assert "helper_thread_waits_here" in text and 'job.py", line 8' in text, text
    assert "ferrodist run: rank 1 was killed by SIGSEGV" in text


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    job = script(
        tmp_path,
        """
        import os, signal, sys, time
        if os.environ["RANK"] == "0":
            time.sleep(0.2)
            sys.exit(1)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
        """,
    )
    start = time.monotonic()
    result = run(2, [job], out=io.BytesIO(), grace=0.5)
    assert time.monotonic() - start < 10
    assert result.returncodes[1] == -signal.SIGKILL


def test_children_of_a_rank_are_stopped_too(tmp_path):
    pidfile = tmp_path / "grandchild"
    job = script(
        tmp_path,
        f"""
        import os, subprocess, sys, time
        if os.environ["RANK"] == "1":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            open({str(pidfile)!r}, "w").write(str(child.pid))
            time.sleep(0.3)
            sys.exit(3)
        time.sleep(60)
        """,
    )
    run(2, [job], out=io.BytesIO(), grace=1)
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild)


def test_a_rank_has_a_process_group_of_its_own_in_the_launchers_session(tmp_path):
    """Linux shares the CPU between sessions (autogroups) before it weighs nice values: ranks
    in sessions of their own would each count as much as a user's busy process at nice 19
    (the 4 KiB all_reduce went from 5 us to 80 us beside one). A group of its own still lets
    the launcher stop a rank with whatever it started (the test above)."""
    said = tmp_path / "said"
    job = script(
        tmp_path,
        f"""
        import os
        with open({str(said)!r} + os.environ["RANK"], "w") as out:
            out.write(f"{{os.getsid(0)}} {{os.getpgid(0)}} {{os.getpid()}}")
        """,
    )
    assert run(2, [job], out=io.BytesIO()).exit_code == 0
    for rank in range(2):
        session, group, pid = map(int, (tmp_path / f"said{rank}").read_text().split())
        assert session == os.getsid(0), (rank, session)
        assert group == pid, (rank, group, pid)


def alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie waiting for a reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_to_the_launcher_reaches_the_ranks(tmp_path):
    job = script(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ferrodist.launch", "run", "-n", "2", job], stdout=subprocess.PIPE, text=True
    )
    assert launcher.stdout is not None
    seen = 0
    while seen < 2:
        if "up" in launcher.stdout.readline():
            seen += 1
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(15) == 128 + signal.SIGTERM
    with launcher.stdout:
        assert "ferrodist run: interrupted by SIGTERM, passed on to ranks [0, 1]\n" in launcher.stdout.read()


def test_console_script_and_module_agree_on_usage_errors(tmp_path):
    with pytest.raises(InvalidArgument, match="at least 1"):
        run(0, ["x.py"])
    assert main(["run", "-n", "1", str(tmp_path / "missing-command-xyz")]) == 2
    done = subprocess.run(
        [sys.executable, "-m", "ferrodist.launch", "--help"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0 and "run" in done.stdout


def test_output_without_a_trailing_newline_and_arguments_pass_through(tmp_path):
    job = script(tmp_path, "import sys\nsys.stdout.write(' '.join(sys.argv[1:]))\n")
    out = io.BytesIO()
    assert run(1, [job, "--flag", "value with spaces"], out=out).exit_code == 0
    assert out.getvalue() == b"[rank 0] --flag value with spaces\n"


def start_launcher(
    tmp_path, body: str, *options: str, ranks: int = 2, setup: str = ""
) -> tuple[subprocess.Popen[str], list[int]]:
    """``ferrodist run`` as a process of its own, once every rank has run ``setup`` and
    written its pid (signals sent after that find the handlers ``setup`` installed)."""
    job = script(
        tmp_path,
        "import os, signal, sys, time\n"
        + textwrap.dedent(setup)
        + f"with open(os.path.join({str(tmp_path)!r}, 'pid' + os.environ['RANK']), 'w') as f:\n"
        "    f.write(str(os.getpid()))\n" + textwrap.dedent(body),
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ferrodist.launch", "run", "-n", str(ranks), *options, job],
        stdout=subprocess.PIPE,
        text=True,
    )
    give_up = time.monotonic() + 20
    files = [tmp_path / f"pid{rank}" for rank in range(ranks)]
    while not all(f.exists() and f.read_text() for f in files):
        if time.monotonic() > give_up or launcher.poll() is not None:
            launcher.kill()
            pytest.fail(f"the ranks never started: {launcher.communicate()[0]}")
        time.sleep(0.02)
    return launcher, [int(f.read_text()) for f in files]


def gone(pids: list[int], seconds: float) -> bool:
    """True if every pid is gone within ``seconds``; else kills the survivors and says False."""
    give_up = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < give_up:
        time.sleep(0.02)
    survivors = [pid for pid in pids if alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    return not survivors


def test_no_rank_outlives_a_launcher_killed_with_sigkill(tmp_path):
    launcher, pids = start_launcher(
        tmp_path, "time.sleep(60)\n", setup="signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    )
    launcher.kill()
    launcher.communicate(timeout=10)
    assert gone(pids, 5), "ranks outlived their launcher"


def test_a_rank_that_ignores_sigint_is_killed_grace_seconds_after_the_launcher_passed_it_on(tmp_path):
    launcher, pids = start_launcher(
        tmp_path,
        "time.sleep(60)\n",
        setup="if os.environ['RANK'] == '1':\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n",
    )
    start = time.monotonic()
    launcher.send_signal(signal.SIGINT)
    out = launcher.communicate(timeout=20)[0]
    assert launcher.returncode == 128 + signal.SIGINT
    assert 3 <= time.monotonic() - start < 10  # the default grace of 3 s, then SIGKILL
    assert "ferrodist run: interrupted by SIGINT, passed on to ranks [0, 1] " in out
    assert "(ranks [1] did not stop and got SIGKILL)" in out
    assert gone(pids, 1)


def test_a_second_signal_to_the_launcher_kills_the_ranks_at_once(tmp_path):
    launcher, pids = start_launcher(
        tmp_path, "time.sleep(60)\n", "--grace", "30", setup="signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    )
    start = time.monotonic()
    launcher.send_signal(signal.SIGINT)
    time.sleep(0.3)
    launcher.send_signal(signal.SIGINT)
    out = launcher.communicate(timeout=20)[0]
    assert time.monotonic() - start < 10 and launcher.returncode == 128 + signal.SIGINT
    assert "(ranks [0, 1] did not stop and got SIGKILL)" in out
    assert gone(pids, 1)


def test_a_reporter_that_exits_first_is_not_blamed(tmp_path):
    # Rank 0 reports (in its error file, as ferrodist does) that it lost rank 1, and exits
    # first; rank 1 hangs. The summary blames rank 1, which the launcher had to stop.
    job = script(
        tmp_path,
        """
        import json, os, sys, time
        if os.environ["RANK"] == "0":
            with open(os.environ["FERRODIST_ERROR_FILE"], "w") as f:
                json.dump({"error": "PeerLost", "blames": [1], "message": "rank 0: lost rank 1"}, f)
            sys.exit(1)
        time.sleep(60)
        """,
    )
    out = io.BytesIO()
    result = run(3, [job], out=out, grace=1)
    assert result.failed_rank == 1 and result.exit_code == 1 and result.stopped == (1, 2)
    assert (
        out.getvalue()
        .decode()
        .endswith(
            "ferrodist run: rank 1 was lost: ranks [0] lost their connection to it "
            "(rank 1 was still running when the launcher stopped it); stopped by the launcher: ranks [1, 2]\n"
        )
    )


def test_a_rank_that_exited_before_the_failure_is_not_listed_as_stopped(tmp_path):
    job = script(
        tmp_path,
        """
        import os, sys, time
        rank = os.environ["RANK"]
        if rank == "0":
            sys.exit(0)
        if rank == "1":
            time.sleep(0.3)
            raise SystemExit(4)
        time.sleep(60)
        """,
    )
    out = io.BytesIO()
    result = run(3, [job], out=out, grace=1)
    assert result.failed_rank == 1 and result.exit_code == 4 and result.stopped == (2,)
    assert "ferrodist run: rank 1 exited with code 4; stopped by the launcher: ranks [2]\n" in out.getvalue().decode()


def test_a_frozen_rank_is_named_by_the_ranks_that_timed_out_waiting_for_it(tmp_path):
    """Rank 2 runs 20 calls with the others, then freezes: it did not come to the 21st (it
    did arrive, so the summary must not say it never did)."""
    job = script(
        tmp_path,
        """
        import time
        import numpy as np
        import ferrodist.collectives as dist
        dist.init_process_group("tcp", timeout=20)
        for _ in range(20):
            dist.all_reduce(np.ones(4))
        if dist.get_rank() == 2:
            time.sleep(60)  # frozen: never reaches the next all_reduce
        dist.all_reduce(np.ones(4), timeout=1)
        """,
    )
    out = io.BytesIO()
    result = run(3, [job], out=out, grace=1)
    summary = out.getvalue().decode().splitlines()[-1]
    assert result.failed_rank == 2 and result.exit_code == 1 and 2 in result.stopped, summary
    assert summary.startswith("ferrodist run: rank 2 did not come to the call in time: ranks [0"), summary
    assert "timed out waiting for it" in summary
    assert "(rank 2 was still running when the launcher stopped it)" in summary


def test_grace_must_be_a_number_of_seconds(tmp_path):
    with pytest.raises(InvalidArgument, match="--grace"):
        run(1, ["x.py"], grace=-1)
    assert main(["run", "-n", "1", "--grace", "nan", str(tmp_path / "x.py")]) == 2


def test_dash_m_runs_a_module_with_its_arguments(tmp_path):
    package = tmp_path / "pkg_helperc"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text("import os, sys\nprint('module', __name__, os.environ['RANK'], *sys.argv[1:])\n")
    out = io.BytesIO()
    result = run(2, ["pkg_helperc.train", "--lr", "0.1"], module=True, out=out, extra_env={"PYTHONPATH": str(tmp_path)})
    assert result.exit_code == 0, out.getvalue()
    assert sorted(out.getvalue().decode().splitlines()) == [
        "[rank 0] module __main__ 0 --lr 0.1",
        "[rank 1] module __main__ 1 --lr 0.1",
    ]


def test_log_dir_gets_each_ranks_output_unlabelled(tmp_path):
    job = script(tmp_path, "import os\nprint('hello from', os.environ['RANK'])\nprint('\\rbar', end='')\n")
    logs = tmp_path / "logs" / "deeper"
    out = io.BytesIO()
    assert run(3, [job], out=out, log_dir=str(logs)).exit_code == 0
    assert sorted(p.name for p in logs.iterdir()) == ["rank-0.log", "rank-1.log", "rank-2.log"]
    for rank in range(3):
        assert (logs / f"rank-{rank}.log").read_bytes() == f"hello from {rank}\n\rbar".encode()
        assert f"[rank {rank}] hello from {rank}\n".encode() in out.getvalue()


def test_a_log_dir_that_cannot_be_made_is_a_clear_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["run", "-n", "1", "--log-dir", str(blocker / "logs"), str(tmp_path / "x.py")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ferrodist run: --log-dir '{blocker / 'logs'}': cannot make it"), err


def test_a_progress_bar_shows_live_through_the_launcher_on_a_terminal(tmp_path):
    import pty
    import tty

    go = tmp_path / "go"
    job = script(
        tmp_path,
        f"""
        import os, sys, time
        sys.stdout.write("\\r 10%")
        sys.stdout.flush()
        while not os.path.exists({str(go)!r}):
            time.sleep(0.02)
        sys.stdout.write("\\r100%\\n")
        """,
    )
    terminal, screen = pty.openpty()
    tty.setraw(screen)  # bytes as written (no \n -> \r\n)
    launcher = subprocess.Popen([sys.executable, "-m", "ferrodist.launch", "run", "-n", "1", job], stdout=screen)
    os.close(screen)
    seen = b""
    give_up = time.monotonic() + 30
    while b"10%" not in seen and time.monotonic() < give_up:
        if select.select([terminal], [], [], 0.5)[0]:
            seen += os.read(terminal, 100)
    go.write_text("")  # the rank is still waiting for this: what we saw came before any newline
    assert launcher.wait(timeout=30) == 0
    rest = b""
    while select.select([terminal], [], [], 0.5)[0]:
        try:
            more = os.read(terminal, 100)
        except OSError:  # the terminal's other end is closed: all read
            break
        if not more:
            break
        rest += more
    os.close(terminal)
    assert seen == b"\r[rank 0]  10%"
    assert rest == b"\r[rank 0] 100%\n"


def test_into_a_file_each_rank_writes_whole_lines_as_a_terminal_would_leave_them(tmp_path):
    """A log has no \r: a progress bar's redraws and the blanks that clear it would run
    together with the lines printed between them. There a line is written whole when it
    ends, as it stands after its redraws."""
    job = script(
        tmp_path,
        """
        import sys
        for i in range(3):
            sys.stdout.write(f"\\rtraining {i}/3")
            sys.stdout.flush()
            sys.stdout.write("\\r" + " " * 20 + "\\r")
            print(f"epoch {i}: done")
        sys.stdout.write("\\rtraining 3/3\\n")
        print("partial", end="")
        """,
    )
    log = tmp_path / "out.log"
    with open(log, "wb") as sink:
        done = subprocess.run(
            [sys.executable, "-m", "ferrodist.launch", "run", "-n", "1", job], stdout=sink, timeout=60
        )
    assert done.returncode == 0
    assert log.read_bytes() == (
        b"[rank 0] epoch 0: done\n[rank 0] epoch 1: done\n[rank 0] epoch 2: done\n"
        b"[rank 0] training 3/3\n[rank 0] partial\n"
    )


def test_version_comes_from_the_installed_package():
    from importlib.metadata import version

    done = subprocess.run(
        [sys.executable, "-m", "ferrodist.launch", "--version"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0 and done.stdout == f"ferrodist {version('ferrodist-launch')}\n"


def test_errors_carry_one_prefix(tmp_path, capsys):
    assert main(["run", "-n", "0", str(tmp_path / "x.py")]) == 2
    assert capsys.readouterr().err == "ferrodist run: -n must be at least 1, not 0\n"
