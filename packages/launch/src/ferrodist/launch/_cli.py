"""The ``ferrodist`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ferrodist.core import FerrodistError

from ._run import run


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferrodist", description="ferrodist: distributed training communication")
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser(
        "run",
        help="run a script as N ranks on this machine",
        description="Start N ranks of SCRIPT, prefix their output with [rank k], and stop the job "
        "(non-zero exit) as soon as one rank fails.",
    )
    start.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    start.add_argument("--master-addr", default="127.0.0.1", help="address of rank 0's store (default 127.0.0.1)")
    start.add_argument("--master-port", type=int, default=None, help="port of rank 0's store (default: a free one)")
    start.add_argument("--grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL on failure")
    start.add_argument("script", help="a .py file (run with this Python) or any command")
    start.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        result = run(
            args.nprocs,
            [args.script, *args.args],
            master_addr=args.master_addr,
            master_port=args.master_port,
            grace=args.grace,
        )
    except FerrodistError as exc:
        print(f"ferrodist: {exc}", file=sys.stderr)
        return 2
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
