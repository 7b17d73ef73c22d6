"""The ``ferrodist`` command."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ._bench.report import plot, table, write_json
from ._bench.sweep import FLOOR, MATPLOTLIB, OPS, REFERENCES, BenchSpec, machine, plot_unavailable, startup, sweep
from ._doctor.report import add_command as add_doctor_command
from ._doctor.report import doctor
from ._run import DEFAULT_GRACE, DEFAULT_JOIN_TIMEOUT, DEFAULT_NODES_PORT, run
from ._warm import add_command as add_warm_command
from ._warm import warm_command


def _version() -> str:
    """The installed ferrodist-launch's version (``unknown`` when run from a bare checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ferrodist-launch")
    except PackageNotFoundError:
        return "unknown (ferrodist-launch is not installed)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferrodist", description="ferrodist: distributed training communication")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser(
        "run",
        help="run a script as N ranks on this machine (one launcher per node for several)",
        description="Start N ranks of SCRIPT, prefix their output with [rank k], stop the job "
        "(non-zero exit) as soon as one rank fails, and name the rank to blame. The ranks die with the launcher. "
        "For a job on several nodes, start one launcher per node with the same --nnodes, --master-addr (node 0's "
        "address) and --master-port, its own --node-rank, and the same FERRODIST_TOKEN exported on every node.",
    )
    start.add_argument(
        "-n",
        "--nprocs",
        "--nproc-per-node",
        type=_ranks,
        required=True,
        metavar="N|MIN:MAX",
        help="number of ranks on this node; MIN:MAX: start MAX, and when a rank fails keep the others running while "
        "at least MIN of this node's have not (their script shrinks its group: ferrodist.elastic), starting a "
        "replacement that joins them",
    )
    start.add_argument("--nnodes", type=int, default=1, help="number of nodes, one launcher each (default 1)")
    start.add_argument("--node-rank", type=int, default=0, help="this node's number, 0 to NNODES-1 (default 0)")
    start.add_argument(
        "--master-addr",
        default="127.0.0.1",
        help="node 0's address: where rank 0's store (and, with --nnodes, node 0's launcher) listens (default 127.0.0.1)",
    )
    start.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="one node: the port of rank 0's store (default: a free one); several nodes: the port node 0's "
        f"launcher listens on for the others (default {DEFAULT_NODES_PORT}; the ranks' store gets a free one)",
    )
    start.add_argument(
        "--join-timeout",
        type=float,
        default=DEFAULT_JOIN_TIMEOUT,
        help=f"seconds node 0 waits for the other nodes' launchers (default {DEFAULT_JOIN_TIMEOUT:g})",
    )
    start.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE,
        help="seconds the ranks get to stop, after a rank failed (SIGTERM) or the launcher was interrupted "
        f"(SIGINT, SIGTERM or SIGHUP, passed on), before SIGKILL (default {DEFAULT_GRACE:g})",
    )
    start.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="when a rank fails, start the whole job again (a new rendezvous, FERRODIST_RESTART_COUNT=k) up to this "
        "many times; give every node's launcher the same number (default 0)",
    )
    start.add_argument("--log-dir", default=None, help="also write each rank's output, unlabelled, to DIR/rank-K.log")
    start.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="trace every rank's collectives, messages, DDP buckets and pipeline actions into DIR "
        "(FERRODIST_TRACE), then merge them into DIR/trace.json and say which rank the others waited for",
    )
    start.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="SCRIPT is a module name: run `python -m SCRIPT ARGS` (with this Python)",
    )
    start.add_argument("script", help="a .py file (run with this Python), a module (with -m) or any command")
    start.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    merge = commands.add_parser(
        "trace",
        help="merge a traced job's files (FERRODIST_TRACE=DIR, or ferrodist run --trace DIR) into one timeline",
        description="Merge DIR/rank-*.json, written by a job run with FERRODIST_TRACE=DIR (or ferrodist run "
        "--trace DIR), into one Chrome trace (DIR/trace.json: open it in https://ui.perfetto.dev or "
        "chrome://tracing) with a process per rank, and print the calls where the ranks waited longest for the "
        "last one, and how often each rank was that one.",
    )
    merge.add_argument("directory", help="the directory the ranks wrote their trace files to")
    merge.add_argument("--out", default=None, help="where to write the merged trace (default DIR/trace.json)")
    merge.add_argument(
        "--png", default=None, help=f"also draw the timeline into this PNG file (needs matplotlib: {MATPLOTLIB})"
    )
    merge.add_argument("--top", type=int, default=10, help="how many of the longest waits to list (default 10)")
    bench = commands.add_parser(
        "bench",
        help="sweep the collectives over sizes and backends (nccl-tests style)",
        description="Time each collective for sizes from --min-bytes to --max-bytes (x4 steps) on each "
        "backend; print time, busbw and, with --compare, the ratio of Gloo's and mpi4py's times to ferrodist's. "
        "Writes files only when asked: --json PATH, --plot PATH.",
    )
    bench.add_argument("-n", "--nprocs", type=int, default=2, help="ranks per job (default 2)")
    bench.add_argument(
        "--backends",
        default="shm,tcp",
        help="ferrodist backends (shm, tcp, mpi; shm-shared: shm with tensors from shared_zeros)",
    )
    bench.add_argument("--ops", default=",".join(OPS), help=f"collectives to time (default {','.join(OPS)})")
    bench.add_argument("--min-bytes", type=int, default=4 << 10, help="smallest tensor in bytes (default 4096)")
    bench.add_argument("--max-bytes", type=int, default=256 << 20, help="largest tensor in bytes (default 256 MiB)")
    bench.add_argument("--dtype", default="float32", help="element type (default float32)")
    bench.add_argument(
        "--rounds", type=int, default=5, help="timed rounds per size; the median round is reported (default 5)"
    )
    bench.add_argument(
        "--passes",
        type=int,
        default=1,
        help="run every library this many times, alternating their order, and keep each one's fastest median",
    )
    bench.add_argument("--compare", action="store_true", help="also run torch.distributed (Gloo) and mpi4py")
    bench.add_argument(
        "--no-floor",
        action="store_true",
        help="skip the memory floor (every rank at once streaming, with numpy, the bytes the collective "
        "must read and write; the table divides the first backend's time by it)",
    )
    bench.add_argument("--startup", action="store_true", help="also time launch + init + one all_reduce")
    bench.add_argument(
        "--json", metavar="PATH", default=None, help="write every measurement, with its busbw, to PATH (JSON)"
    )
    bench.add_argument(
        "--plot",
        metavar="PATH",
        default=None,
        help=f"draw busbw against size, log-log, one panel per collective, to PATH (PNG; needs matplotlib: {MATPLOTLIB})",
    )
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_doctor_command(commands)
    add_warm_command(commands)
    return parser


def _bench(args: argparse.Namespace) -> int:
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder is not None and not os.path.isdir(folder):
            print(
                f"ferrodist bench: {option} {path}: there is no directory {folder}; make it or choose another path",
                file=sys.stderr,
            )
            return 2
    no_plot = plot_unavailable() if args.plot else None
    if no_plot:
        print(
            f"ferrodist bench: --plot {args.plot}: {no_plot}; the sweep runs and prints its table, but draws nothing",
            file=sys.stderr,
        )
    sizes = []
    size = args.min_bytes
    while size <= args.max_bytes:
        sizes.append(size)
        size *= 4
    libraries = [f"ferrodist:{b.strip()}" for b in args.backends.split(",") if b.strip()]
    if args.compare:
        libraries += list(REFERENCES)
    if not args.no_floor:
        libraries.append(FLOOR)
    spec = BenchSpec(
        nprocs=args.nprocs,
        libraries=libraries,
        ops=[op.strip() for op in args.ops.split(",")],
        sizes=sizes,
        dtype=args.dtype,
        rounds=args.rounds,
        passes=args.passes,
    )
    records = sweep(spec, show_progress=not args.no_progress)
    for library, why in spec.skipped.items():
        print(f"skipped {library}: {why}")
    print(table(records, baseline=libraries[0]))
    extra: dict[str, object] = {"machine": machine(), "ranks": args.nprocs, "skipped": spec.skipped}
    if args.startup:
        launch = startup(args.nprocs)
        extra["startup_seconds"] = launch
        print("### launch + init + one all_reduce + exit (median of 5)\n")
        print("| launcher | seconds |\n|---|---|")
        for name, seconds in launch.items():
            print(f"| {name} | {seconds:.2f} |")
        print()
    if args.json:
        write_json(args.json, records, extra)
        print(f"wrote {args.json}")
    if no_plot:
        print(f"ferrodist bench: did not draw {args.plot}: {no_plot}", file=sys.stderr)
        return 1
    if args.plot:
        plot(args.plot, [r for r in records if r["library"] != FLOOR])  # the floor has no busbw
        print(f"wrote {args.plot}")
    return 0


def _ranks(text: str) -> tuple[int, int]:
    """``-n``: ``N`` (MIN = MAX = N) or ``MIN:MAX``."""
    low, _, high = text.partition(":")
    try:
        least, most = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX (whole numbers), not {text!r}") from None
    return least, most


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    if args.command == "doctor":
        return doctor(args)
    if args.command == "warm":
        return warm_command(args)
    if args.command == "trace":
        return _trace_command(args.directory, args.out, args.png, args.top)
    trace = None if args.trace is None else os.path.abspath(args.trace)
    try:
        least, most = args.nprocs
        result = run(
            most,
            [args.script, *args.args],
            module=args.module,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            grace=args.grace,
            join_timeout=args.join_timeout,
            log_dir=args.log_dir,
            extra_env=None if trace is None else {"FERRODIST_TRACE": trace},
            max_restarts=args.max_restarts,
            min_ranks=least if least != most else None,
        )
    except Exception as exc:
        # ferrodist.core (numpy, ml_dtypes) is imported only here: `ferrodist run` starts the
        # ranks without waiting for it.
        from ferrodist.core import FerrodistError

        if not isinstance(exc, FerrodistError):
            raise
        message = str(exc)
        print(message if message.startswith("ferrodist") else f"ferrodist run: {message}", file=sys.stderr)
        return 2
    if trace is not None and os.path.isdir(trace) and any(n.startswith("rank-") for n in os.listdir(trace)):
        _trace_command(trace, None, None, 10)
    return result.exit_code


def _trace_command(directory: str, out: str | None, png: str | None, top: int) -> int:
    """``ferrodist trace DIR``: merge the ranks' trace files and print what they show."""
    from ferrodist.core import FerrodistError

    from . import _trace

    no_png = plot_unavailable() if png is not None else None
    if no_png:
        print(
            f"ferrodist trace: --png {png}: {no_png}; the trace is merged and summed up, but not drawn", file=sys.stderr
        )
    try:
        merged = _trace.merge(directory, out)
        print(_trace.summary(merged, top))
        if png is not None and not no_png:
            _trace.render_png(merged, png)
            print(f"wrote {png}")
    except FerrodistError as exc:
        print(
            exc.message if exc.message.startswith("ferrodist") else f"ferrodist trace: {exc.message}", file=sys.stderr
        )
        return 2
    if no_png:  # as `bench --plot`: the work is done, the picture is not (1, not a usage error)
        print(f"ferrodist trace: did not draw {png}: {no_png}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
