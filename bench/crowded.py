"""Run a command on a crowded machine: beside busy processes that keep cores taken, as on a
shared CI runner or cluster node.

    python bench/crowded.py --busy 8 [--nice 0] -- COMMAND [ARGS...]
    python bench/crowded.py --figures [--json out.json]

``--busy N`` processes spin for as long as the command runs (started two seconds before it,
so that the machine's load has risen); ``--nice`` is their priority (19: a background job
that gives its core to anything else). The command's exit status is this one's.

``--figures`` runs the comparisons of docs/benchmarks.md ("On a crowded machine") one after
the other: the 4 KiB all_reduce of ``ferrodist bench --compare`` (shm, mpi4py, Gloo) in each
crowd of ``CROWDS``, and the communication-bound DDP step of bench/ddp/run.py (Gloo, shm, tcp)
in the crowded ones; each reference is measured in the same command as ferrodist.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

#: A busy process: it spins, and ends once the process that started it is gone.
SPIN = (
    "import os\nos.nice({nice})\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(200000): pass"
)
#: The crowds the figures are measured in: (name, busy processes, their nice value).
CROWDS = (
    ("quiet", 0, 0),
    ("beside 1 busy process at nice 19", 1, 19),
    ("beside 8 busy processes at nice 0", 8, 0),
)
SMALL_CALL = (
    "ferrodist", "bench", "-n", "2", "--backends", "shm", "--compare", "--ops", "all_reduce",
    "--max-bytes", "4096", "--no-progress",
)  # fmt: skip
DDP_CONFIGS = "ferrodist DDP, shm;ferrodist DDP, tcp"
DDP = ("bench/ddp/run.py", "--rounds", "1", "--batches", "small", "--configs", DDP_CONFIGS)


@contextmanager
def crowd(busy: int, nice: int) -> Iterator[None]:
    """``busy`` spinning processes at ``nice`` for the duration of the block (2 s head start)."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN.format(nice=nice)]) for _ in range(busy)]
    try:
        if spinners:
            time.sleep(2.0)
        print(f"crowded.py: {busy} busy processes at nice {nice}; load {os.getloadavg()[0]:.1f}", file=sys.stderr)
        yield
    finally:
        for process in spinners:
            process.kill()
        for process in spinners:
            process.wait()


def _measured(command: Sequence[str], busy: int, nice: int) -> object:
    """What ``command --json FILE`` wrote, run in the crowd; exits if the command fails."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "out.json"
        with crowd(busy, nice):
            status = subprocess.call([*command, "--json", str(out)])
        if status != 0 or not out.exists():
            raise SystemExit(f"crowded.py: {' '.join(command)} failed (exit {status})")
        return json.loads(out.read_text())


def figures() -> dict[str, object]:
    """The small call in every crowd and DDP in the crowded ones: {"small_call": {crowd:
    records}, "ddp": {crowd: DDP's results}}."""
    small: dict[str, object] = {}
    ddp: dict[str, object] = {}
    for name, busy, nice in CROWDS:
        small[name] = _measured(SMALL_CALL, busy, nice)
        if busy:
            ddp[name] = _measured((sys.executable, *DDP), busy, nice)
    return {"small_call": small, "ddp": ddp}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", type=int, help="busy processes to start")
    parser.add_argument("--nice", type=int, default=0, help="their nice value (default 0)")
    parser.add_argument("--figures", action="store_true", help="run the comparisons of docs/benchmarks.md")
    parser.add_argument("--json", type=Path, help="--figures: write the measurements here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args()
    if args.figures:
        found = figures()
        text = json.dumps(found, indent=1)
        if args.json:
            args.json.write_text(text + "\n")
        else:
            print(text)
        return
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.busy is None or not command:
        parser.error("give --busy N and the command to run after -- (or --figures)")
    with crowd(args.busy, args.nice):
        status = subprocess.call(command)
    sys.exit(status)


if __name__ == "__main__":
    main()
