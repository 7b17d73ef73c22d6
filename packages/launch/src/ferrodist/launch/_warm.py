"""``ferrodist warm``: compile the kernels a job will need before it starts.

A job on an empty kernel cache runs its interpreted paths until its kernels have compiled
beside it (seconds to a minute of CPU). This fills Numba's disk cache with the kernels of
the collectives for the given dtypes (every transport's loops and every reduction, up to
the given number of ranks per host), in one compile helper per core, so that every later
process loads them in milliseconds. ``--check`` only counts what the cache holds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

__all__ = ["DEFAULT_DTYPES", "add_command", "kernel_list", "warm_command"]

#: What most jobs move: float32 and float64, the two 16-bit floats of mixed precision,
#: torch's default integer, and bool (whose bytes also carry pickled objects).
DEFAULT_DTYPES = ("float32", "float64", "bfloat16", "float16", "int64", "bool")
#: Ranks per host the reductions are compiled for by default.
DEFAULT_RANKS = 4


def add_command(commands: Any) -> None:
    """Add ``warm`` to the ``ferrodist`` command's subparsers."""
    warm = commands.add_parser(
        "warm",
        help="compile the kernels a job will need, once for this install (a job's first steps are then fast)",
        description="Compile into Numba's disk cache the kernels of the collectives for the given dtypes: the "
        "shared-memory loops, tcp's small frames and the reductions, for up to --ranks ranks per host. Kernels "
        "already cached are skipped; the ranks and other warm commands of this host never compile one twice. "
        "A job finds what is missing and compiles it beside its first steps, so this is never required; it "
        "makes the first job as fast as the next.",
    )
    warm.add_argument(
        "--dtypes",
        default=",".join(DEFAULT_DTYPES),
        help=f"comma-separated dtypes, or 'all' (default {','.join(DEFAULT_DTYPES)})",
    )
    warm.add_argument(
        "--ranks",
        type=int,
        default=DEFAULT_RANKS,
        help=f"the most ranks a job runs on one host (default {DEFAULT_RANKS}; more compiles more)",
    )
    warm.add_argument("--processes", type=int, default=None, help="compile helpers at once (default: one per core)")
    warm.add_argument(
        "--check", action="store_true", help="compile nothing: say how much is cached, exit 1 unless all of it"
    )
    warm.add_argument("--quiet", action="store_true", help="print only problems")


def kernel_list(dtype_names: list[str] | tuple[str, ...], ranks: int) -> list[Any]:
    """Every kernel ``warm`` compiles for these dtypes and ranks per host."""
    from ferrodist.collectives import collective_kernels
    from ferrodist.core import ALL_DTYPES, dtype

    dtypes = list(ALL_DTYPES) if list(dtype_names) == ["all"] else [dtype(name) for name in dtype_names]
    return collective_kernels(dtypes, ranks=ranks)


def warm_command(args: argparse.Namespace) -> int:
    from ferrodist.core import FerrodistError
    from ferrodist.core.kernels import cached, warm

    names = [name.strip() for name in args.dtypes.split(",") if name.strip()]
    if args.ranks < 1 or (args.processes is not None and args.processes < 1):
        print("ferrodist warm: --ranks and --processes take a positive number", file=sys.stderr)
        return 2
    try:
        kernels = kernel_list(names, args.ranks)
    except FerrodistError as exc:
        print(f"ferrodist warm: --dtypes {args.dtypes}: {exc}", file=sys.stderr)
        return 2
    what = f"{len(kernels)} kernels for {', '.join(names)} (up to {args.ranks} ranks a host)"
    held, total = cached(kernels)
    if args.check:
        print(f"ferrodist warm: {held} of {what} are cached" + ("" if held == total else "; run `ferrodist warm`"))
        return 0 if held == total else 1
    if held == total:
        if not args.quiet:
            print(f"ferrodist warm: all {what} are cached already")
        return 0
    if not args.quiet:
        processes = min(args.processes or os.cpu_count() or 1, total - held)
        print(f"ferrodist warm: {what}: {held} cached, {total - held} to compile ({processes} at a time)", flush=True)
    show = not args.quiet and sys.stderr.isatty()
    started = time.monotonic()

    def progress(done: int, todo: int) -> None:
        if show:
            print(
                f"\r  {done}/{todo} compiled, {time.monotonic() - started:.0f} s", end="", file=sys.stderr, flush=True
            )

    result = warm(kernels, processes=args.processes, progress=progress)
    if show and result.compiled + len(result.failed):
        print(file=sys.stderr)
    for failure in result.failed:
        print(f"ferrodist warm: could not compile {failure}", file=sys.stderr)
    if not args.quiet:
        print(
            f"ferrodist warm: compiled {result.compiled} in {result.seconds:.1f} s; {cached(kernels)[0]} of {total} cached"
        )
    return 1 if result.failed else 0
