"""`ferrodist run`: environment, labelled output, failure propagation, signals, errors."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ferrodist.core import InvalidArgument
from ferrodist.launch import main, run


def script(tmp_path, body: str):
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


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
    assert "ferrodist run: rank 2 exited with code 7; stopped ranks [0, 1]" in out.getvalue().decode()


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
        assert "was killed by SIGTERM" in launcher.stdout.read()


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
