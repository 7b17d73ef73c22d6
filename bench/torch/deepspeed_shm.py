"""ferrodist's all_reduce beside DeepSpeed's CPU shared-memory all_reduce, in one job.

    LOCAL_SIZE=2 ferrodist run -n 2 bench/torch/deepspeed_shm.py [--sizes 4K,16K,64K,256K,1M,4M]
                                                                  [--dtypes float32,bfloat16] [--passes 3]

Needs torch and DeepSpeed (``pip install deepspeed``; its shared-memory op is compiled with
the machine's C++ compiler at the first run). The default torch group has backend
"ferrodist"; DeepSpeed is started on it (``deepspeed.init_distributed``) and makes its own
shared memory for ``deepspeed.comm.inference_all_reduce`` (one-shot below 1 MiB, waits that
spin). For every dtype and size rank 0 prints the time of one SUM all_reduce through: the
ferrodist API on a numpy array, the same on a torch tensor, ``torch.distributed.all_reduce``
on the "ferrodist" group, and DeepSpeed's; and DeepSpeed's time over each of ferrodist's
(above 1.00: ferrodist is faster). Each way runs ``--passes`` times in turn, each pass
``calls`` calls (fewer for large sizes); each keeps its fastest pass.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from small_call import per_call_us  # this directory's

import ferrodist.collectives as fd
import ferrodist.torch  # noqa: F401  (registers the backend)
from ferrodist.core import dtype as ferrodist_dtype
from ferrodist.torch import FerrodistProcessGroup


def size_of(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_SIZE", os.environ["WORLD_SIZE"])  # DeepSpeed's shm needs every rank local
    try:
        import deepspeed
        import deepspeed.comm as ds_comm
    except ImportError:
        print("needs DeepSpeed: pip install deepspeed", file=sys.stderr)
        return 2
    dist.init_process_group("ferrodist")
    deepspeed.init_distributed()  # on the group above
    pg = dist.distributed_c10d._get_default_group()
    ours = pg._get_backend(torch.device("cpu")) if not isinstance(pg, FerrodistProcessGroup) else pg
    group = ours.ferrodist_group
    rank = dist.get_rank()
    if rank == 0:
        print(f"{dist.get_world_size()} ranks; microseconds per all_reduce (fastest of {args.passes} passes)")
        print(
            '| dtype | size | ferrodist API, numpy | ferrodist API, tensor | torch.distributed, "ferrodist" '
            "| DeepSpeed inference_all_reduce | DeepSpeed / API | DeepSpeed / torch.distributed |"
        )
        print("|---|---|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dt = ferrodist_dtype(name)
        for text in args.sizes.split(","):
            nbytes = size_of(text)
            count = nbytes // dt.itemsize
            calls = max(50, min(5000, (400 << 20) // nbytes))
            array = np.ones(count, dt.numpy)
            a, b, c = (torch.ones(count, dtype=getattr(torch, name)) for _ in range(3))
            ways: dict[str, Callable[[], object]] = {
                "api": lambda x=array: fd.all_reduce(x, group=group),
                "tensor": lambda x=a: fd.all_reduce(x, group=group),
                "torch": lambda x=b: dist.all_reduce(x),
                "deepspeed": lambda x=c: ds_comm.inference_all_reduce(x),
            }
            best = {way: float("inf") for way in ways}
            for run in ways.values():  # warm: plans made, loops compiled
                for _ in range(20):
                    run()
            for _ in range(args.passes):
                for way, run in ways.items():
                    best[way] = min(best[way], per_call_us(run, calls, dist.barrier))
            if rank == 0:
                cells = " | ".join(f"{best[w]:.1f}" for w in ways)
                print(
                    f"| {name} | {text} | {cells} | {best['deepspeed'] / best['api']:.2f} | "
                    f"{best['deepspeed'] / best['torch']:.2f} |",
                    flush=True,
                )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
