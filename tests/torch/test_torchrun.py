"""The "ferrodist" torch.distributed backend in real processes under torchrun (2 ranks on
this host; once under `ferrodist run`): every collective against numpy references, torch's DDP against the same over
Gloo (bit-equal), torch.distributed.pipelining against one process, and failures (a rank
killed, sizes that disagree, a rank that skips a call, a rank killed during DDP's backward)
each raising the right error on every survivor within its deadline.

The scripts in scripts/ say what each run does; each rank's output is read from its own
file (torchrun ``--log-dir --redirects 3``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("ferrodist.torch", reason="ferrodist-torch is not installed (pip install packages/torch)")

SCRIPTS = Path(__file__).parent / "scripts"
#: The longest one torchrun job may take (each takes a few seconds here).
JOB_LIMIT = 240
#: Variables of an enclosing job that must not reach torchrun's workers.
_PLACE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FERRODIST_TOKEN")


def torchrun(
    tmp_path: Path,
    script: str,
    *args: str,
    transport: str = "auto",
    options: tuple[str, ...] = (),
    ranks: int = 2,
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run ``scripts/<script> ARGS`` under torchrun with ``ranks`` ranks on this host; the job
    and each rank's standard output (torchrun's own output when a rank wrote nothing)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _PLACE and not k.startswith(("OMPI_", "PMI", "SLURM_", "TORCHELASTIC_"))
    }
    env.update(FERRODIST_TORCH_TRANSPORT=transport, PYTHONUNBUFFERED="1")
    logs = tmp_path / "logs"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "--log-dir",
        str(logs),
        "--redirects",
        "3",
        *options,
        str(SCRIPTS / script),
        *args,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=JOB_LIMIT, cwd=tmp_path)
    outputs = []
    for rank in range(ranks):
        found = sorted(logs.glob(f"*/attempt_0/{rank}/stdout.log"))
        outputs.append(found[-1].read_text() if found else "")
    return done, outputs


def errors_of(tmp_path: Path, rank: int) -> str:
    """What ``rank`` wrote to its standard error in the last ``torchrun`` job under ``tmp_path``."""
    found = sorted((tmp_path / "logs").glob(f"*/attempt_0/{rank}/stderr.log"))
    return found[-1].read_text() if found else ""


def explain(done: subprocess.CompletedProcess[str], outputs: list[str]) -> str:
    ranks = "\n".join(f"--- rank {r} ---\n{out}" for r, out in enumerate(outputs))
    return f"torchrun exited {done.returncode}\n{ranks}\n--- torchrun ---\n{done.stdout[-3000:]}{done.stderr[-3000:]}"


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_every_collective_matches_the_numpy_references(tmp_path, transport):
    done, outputs = torchrun(tmp_path, "collectives.py", transport=transport)
    assert done.returncode == 0, explain(done, outputs)
    name = {"shm": "ShmTransport", "tcp": "TcpTransport"}[transport]
    for rank, out in enumerate(outputs):
        found = re.search(rf"rank {rank} of 2: (\d+) cases passed over {name}", out)
        assert found is not None, explain(done, outputs)
        assert int(found.group(1)) >= 150  # every dtype x op, the copies, all_to_all, p2p, forms
        # the default group started the only transport: every new_group (several in the
        # script, and DeviceMesh dimensions alike) is a subgroup over it
        assert f"rank {rank}: transports started: 1;" in out, explain(done, outputs)
    # no FERRODIST_TOKEN: torch's store holds no secret, the job is open, and rank 0 alone says so, once
    said = [errors_of(tmp_path, rank).count("FERRODIST_TOKEN is not set") for rank in range(2)]
    assert said == [1, 0], [errors_of(tmp_path, rank)[-2000:] for rank in range(2)]
    assert "reaches MASTER_PORT" in errors_of(tmp_path, 0)


def test_ferrodist_run_starts_the_torch_backend_too(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in _PLACE and not k.startswith(("OMPI_", "PMI", "SLURM_"))}
    command = [sys.executable, "-m", "ferrodist.launch", "run", "-n", "2", str(SCRIPTS / "collectives.py")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=JOB_LIMIT, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(2):
        assert re.search(rf"\[rank {rank}\] rank {rank} of 2: \d+ cases passed over ShmTransport", done.stdout), (
            done.stdout + done.stderr
        )


@pytest.mark.timeout(240)
def test_a_torch_job_over_two_nodes_runs_its_default_group_over_two_levels(tmp_path):
    """Two ``ferrodist run --nnodes 2`` launchers on this host, 2 ranks each: the launcher
    says the ranks span nodes, so the "ferrodist" backend's default group runs over shared
    memory inside each node and tcp between (scripts/levels.py checks every collective)."""
    import secrets

    from _helpers import communicate_all, free_port

    env = {k: v for k, v in os.environ.items() if k not in _PLACE and not k.startswith(("OMPI_", "PMI", "SLURM_"))}
    env.update(FERRODIST_TOKEN=secrets.token_hex(16), PYTHONUNBUFFERED="1")
    env.pop("GROUP_RANK", None)
    env.pop("FERRODIST_TORCH_TRANSPORT", None)
    job = ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-n", "2", str(SCRIPTS / "levels.py")]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ferrodist.launch", "run", "--nnodes", "2", "--node-rank", str(node), *job],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
        )
        for node in range(2)
    ]
    outputs = communicate_all(procs, 200)
    assert [p.returncode for p in procs] == [0, 0], outputs
    for rank in range(4):
        assert f"rank {rank}: torch over two nodes, backend=levels, checks=23" in "".join(outputs), outputs


def test_torch_ddp_over_ferrodist_equals_torch_ddp_over_gloo(tmp_path):
    done, outputs = torchrun(tmp_path, "ddp.py", "4")
    assert done.returncode == 0, explain(done, outputs)
    configs = ("default", "small-buckets", "grad-views", "unused-params", "fp16-hook", "no-sync")
    for rank, out in enumerate(outputs):
        for config in configs:
            line = f"rank {rank}: ddp {config}: max |ferrodist - gloo| = 0 (bit-equal: True)"
            assert line in out, explain(done, outputs)
            assert f"rank {rank}: ddp {config}: parameters agree across ranks" in out, explain(done, outputs)


#: torch's clients of a process group (scripts/clients.py runs each on both backends).
CLIENTS = (
    "functional", "dtensor", "tensor-parallel", "fsdp1-full-shard", "fsdp1-full-shard-orig-params",
    "fsdp1-shard-grad-op", "fsdp1-shard-grad-op-orig-params", "fsdp2", "fsdp2-bfloat16", "fsdp2-sum",
    "checkpoint", "pipelining-gpipe", "pipelining-1f1b",
)  # fmt: skip
#: Clients whose results cannot depend on the order in which ranks' values are added.
ORDER_FREE = ("functional", "pipelining-gpipe", "pipelining-1f1b")


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_torch_clients_over_ferrodist_equal_the_same_over_gloo(tmp_path, ranks):
    """Functional collectives, DTensor, tensor parallel, FSDP1 (both sharding modes, with and
    without use_orig_params), FSDP2 (float32, bfloat16, summed), a distributed checkpoint and
    pipelining, each trained or run on both backends. At 2 ranks every result is Gloo's bit
    for bit. With more, a sum of three or more ranks' floats depends on the order it is done
    in (ferrodist adds in rank order, Gloo along its ring), so those results agree to float32
    rounding and the order-free ones stay bit-equal."""
    done, outputs = torchrun(tmp_path, "clients.py", transport="shm", ranks=ranks)
    assert done.returncode == 0, explain(done, outputs)
    line = r"rank {rank} of {ranks}: client {name}: bit-equal to gloo: (\w+) \(max \|diff\| (\S+), (\d+) tensors\)"
    for rank, out in enumerate(outputs):
        for name in CLIENTS:
            found = re.search(line.format(rank=rank, ranks=ranks, name=re.escape(name)), out)
            assert found is not None, explain(done, outputs)
            equal, diff, count = found.group(1) == "True", float(found.group(2)), int(found.group(3))
            assert count > 0, found.group(0)
            if ranks == 2 or name in ORDER_FREE:
                assert equal, found.group(0)
            else:
                assert diff <= 1e-5, found.group(0)


def test_torch_pipelining_over_ferrodist_equals_one_process(tmp_path):
    done, outputs = torchrun(tmp_path, "pipelining.py", "4")
    assert done.returncode == 0, explain(done, outputs)
    pattern = r"rank {rank}: pipelining {name}: max \|pipeline - one process\| = (\S+) over 4 steps \((.*)\)"
    for rank, out in enumerate(outputs):
        for name in ("GPipe", "1F1B", "interleaved-1F1B"):
            found = re.search(pattern.format(rank=rank, name=re.escape(name)), out)
            assert found is not None, explain(done, outputs)
            assert float(found.group(1)) <= 1e-5, found.group(0)  # float32, the same operations
            if rank == 1:  # the last stage has the losses
                first, last, diff = re.fullmatch(
                    r"losses (\S+) \.\. (\S+), max \|diff\| (\S+)", found.group(2)
                ).groups()
                assert float(diff) <= 1e-5, found.group(0)
                assert float(last) < float(first), found.group(0)  # it trained


# -- failures -------------------------------------------------------------------------------------------

#: mode: (the survivors, their error class, what its message says, its deadline in seconds);
#: the message's {rank} is the survivor, {other} the other rank, {mine}/{theirs} their sizes
FAULTS = {
    "kill": ([0], "PeerLost", r"rank {rank}: all_reduce #1 on group torch:0 .*rank {other}", 60.0),
    "mismatch": (
        [0, 1],
        "CollectiveMismatch",
        r"rank {rank}: all_reduce #1 on group torch:0 .*rank {other} is in all_reduce\(float32 x {theirs}, op=SUM\) "
        r"while this rank is in all_reduce\(float32 x {mine}, op=SUM\)",
        60.0,
    ),
    "skip": (
        [0],
        "CollectiveTimeout",
        r"rank {rank}: all_reduce #1 on group torch:0 .*rank {other} never reached",
        3.0,
    ),
    # torch's C++ reducer waits for DDP's all_reduces; a failed future reaches Python as its
    # RuntimeError, naming ferrodist's error
    "ddp-kill": ([0], "RuntimeError", r"PeerLost: rank {rank}: all_reduce #\d+ on group torch:0 .*rank {other}", 60.0),
}
#: A failure seen at once (a peer gone, a mismatch) raises within this many seconds, far
#: inside its deadline; a timeout raises within its deadline plus this slack (ferrodist
#: states 1 s; a loaded 2-core machine gets more).
AT_ONCE, SLACK = 10.0, 3.0


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("mode", list(FAULTS))
def test_a_failure_raises_the_right_error_on_every_survivor(tmp_path, mode, transport):
    survivors, cls, message, deadline = FAULTS[mode]
    done, outputs = torchrun(tmp_path, "faults.py", mode, str(tmp_path), transport=transport)
    assert done.returncode != 0, explain(done, outputs)
    for rank in survivors:
        path = tmp_path / f"error{rank}.json"
        assert path.exists(), f"rank {rank} recorded no error\n" + explain(done, outputs)
        error = json.loads(path.read_text())
        assert error["class"] == cls, error
        sizes = {"mine": 20 if rank == 1 else 10, "theirs": 10 if rank == 1 else 20}
        assert re.search(message.format(rank=rank, other=1 - rank, **sizes), error["message"], re.S), error
        if mode == "skip":
            assert deadline - 0.1 <= error["seconds"] <= deadline + SLACK, error
            assert error["waiting_for"] == [1], error
        else:
            assert error["seconds"] <= AT_ONCE, error
        if mode in ("kill", "mismatch"):
            assert error["peer"] == 1 - rank, error
        # the failed call aborted the group: the next call says so at once
        after = error["after"]
        assert after is not None and after["class"] == "GroupAborted", error
        assert after["seconds"] <= AT_ONCE, after
