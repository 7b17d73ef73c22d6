"""torch's distributed clients over "ferrodist" against the same over Gloo, in one job (run
under torchrun: ``clients.py CLIENT ...``, or without CLIENTs every one of ``CLIENTS``).

The default group is ferrodist's; a second group over the same ranks is Gloo's. Each client
runs twice from the same seed, once on each group, and the two results are compared bit
for bit. Prints, per rank and client::

    rank R of N: client <name>: bit-equal to gloo: True (max |diff| 0, K tensors)

The clients: functional collectives; DTensor (distribute, redistribute, a sharded matmul);
tensor parallel (``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``, a few
training steps); FSDP1 (``FullyShardedDataParallel``, full-shard and shard-grad-op, with
``use_orig_params`` on and off, a few training steps); FSDP2 (``fully_shard`` in float32,
in bfloat16 mixed precision, and summing gradients instead of averaging); a distributed
checkpoint of an FSDP2 model (``torch.distributed.checkpoint`` save, then load into a fresh
model); and ``torch.distributed.pipelining`` (GPipe and 1F1B over every rank).
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy, ShardingStrategy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import ferrodist.torch  # noqa: F401  (registers the backend)

STEPS = 3
Result = list[torch.Tensor]


def mlp(width: int = 16) -> nn.Sequential:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's own batches (a seed per rank)."""
    data = torch.Generator().manual_seed(100 + dist.get_rank())
    return [(torch.randn(6, 8, generator=data), torch.randn(6, 4, generator=data)) for _ in range(steps)]


def train(model: nn.Module, steps: int = STEPS, *, same_data: bool = False) -> list[torch.Tensor]:
    """A few SGD steps; the losses (``same_data``: every rank the same batches, as tensor
    parallelism needs)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    if same_data:
        data = torch.Generator().manual_seed(100)
        steps_data = [(torch.randn(6, 8, generator=data), torch.randn(6, 4, generator=data)) for _ in range(steps)]
    else:
        steps_data = batches(steps)
    for x, y in steps_data:
        optimizer.zero_grad()
        loss = ((model(x).float() - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's local part (a DTensor's shard), detached and cloned."""
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().clone()


# -- the clients: each takes a group and returns the tensors to compare --------------------------------
def functional(group: dist.ProcessGroup) -> Result:
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_tensor's new name is not in every torch
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.arange(size * 3, dtype=torch.float32) * (rank + 1)
    out = [
        funcol.all_reduce(x, "sum", group),
        funcol.all_reduce(x, "max", group),
        funcol.all_gather_tensor(x, 0, group),
        funcol.reduce_scatter_tensor(x, "sum", 0, group),
        funcol.all_to_all_single(x, None, None, group),
        funcol.broadcast(x, 1, group),
    ]
    return [funcol.wait_tensor(t).clone() for t in out]


def dtensor(group: dist.ProcessGroup) -> Result:
    mesh = DeviceMesh.from_group(group, "cpu")
    size = dist.get_world_size()
    torch.manual_seed(3)
    a, b = torch.randn(4 * size, 6), torch.randn(6, 5)
    sharded = distribute_tensor(a, mesh, [Shard(0)])
    columns = sharded.redistribute(mesh, [Shard(1)])
    whole = sharded.redistribute(mesh, [Replicate()])
    product = sharded @ distribute_tensor(b, mesh, [Replicate()])
    return [local(sharded), local(columns), local(whole), product.full_tensor(), (sharded * 2).sum().full_tensor()]


def tensor_parallel(group: dist.ProcessGroup) -> Result:
    mesh = DeviceMesh.from_group(group, "cpu")
    model = mlp(8 * dist.get_world_size())
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    losses = train(model, same_data=True)
    return losses + [p.full_tensor() if hasattr(p, "full_tensor") else local(p) for p in model.parameters()]


def fsdp1(group: dist.ProcessGroup, strategy: ShardingStrategy, use_orig_params: bool) -> Result:
    model = FSDP(
        mlp(),
        process_group=group,
        sharding_strategy=strategy,
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
        auto_wrap_policy=lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, nn.Linear),
    )
    losses = train(model)
    return losses + [local(p) for p in model.parameters()]


def fsdp2(group: dist.ProcessGroup, mixed: bool = False, summed: bool = False) -> Result:
    mesh = DeviceMesh.from_group(group, "cpu")
    model = mlp()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    options = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    if summed:
        model.set_gradient_divide_factor(1.0)
    losses = train(model)
    return losses + [local(p) for p in model.parameters()]


def checkpoint(group: dist.ProcessGroup) -> Result:
    mesh = DeviceMesh.from_group(group, "cpu")
    model = mlp()
    fully_shard(model, mesh=mesh)
    train(model, 1)
    where = [tempfile.mkdtemp(prefix="ferrodist-dcp-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(where, src=0, group=group)
    dcp.save(get_model_state_dict(model), checkpoint_id=where[0], process_group=group)
    fresh = mlp(16)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fully_shard(fresh, mesh=mesh)
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=where[0], process_group=group)
    set_model_state_dict(fresh, state)
    saved, loaded = [local(p) for p in model.parameters()], [local(p) for p in fresh.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(saved, loaded, strict=True)), "the loaded model differs from the saved"
    return loaded


def pipelining(group: dist.ProcessGroup, schedule: type) -> Result:
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(5)
    layers = [nn.Linear(8, 8) for _ in range(size)]
    stage = PipelineStage(layers[rank], rank, size, torch.device("cpu"), group=group)
    run = schedule(stage, 4, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    optimizer = torch.optim.SGD(layers[rank].parameters(), lr=0.05)
    data = torch.Generator().manual_seed(9)
    losses: list[torch.Tensor] = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 8, generator=data), torch.randn(8, 8, generator=data)
        optimizer.zero_grad()
        step_losses: list[torch.Tensor] = []
        if rank == 0:
            run.step(x)
        elif rank == size - 1:
            run.step(target=y, losses=step_losses)
        else:
            run.step()
        optimizer.step()
        losses.extend(t.detach() for t in step_losses)
    return losses + [local(p) for p in layers[rank].parameters()]


CLIENTS: dict[str, Callable[[dist.ProcessGroup], Result]] = {
    "functional": functional,
    "dtensor": dtensor,
    "tensor-parallel": tensor_parallel,
    "fsdp1-full-shard": lambda g: fsdp1(g, ShardingStrategy.FULL_SHARD, False),
    "fsdp1-full-shard-orig-params": lambda g: fsdp1(g, ShardingStrategy.FULL_SHARD, True),
    "fsdp1-shard-grad-op": lambda g: fsdp1(g, ShardingStrategy.SHARD_GRAD_OP, False),
    "fsdp1-shard-grad-op-orig-params": lambda g: fsdp1(g, ShardingStrategy.SHARD_GRAD_OP, True),
    "fsdp2": fsdp2,
    "fsdp2-bfloat16": lambda g: fsdp2(g, mixed=True),
    "fsdp2-sum": lambda g: fsdp2(g, summed=True),
    "checkpoint": checkpoint,
    "pipelining-gpipe": lambda g: pipelining(g, ScheduleGPipe),
    "pipelining-1f1b": lambda g: pipelining(g, Schedule1F1B),
}


def main() -> None:
    chosen = sys.argv[1:] or list(CLIENTS)
    dist.init_process_group("ferrodist")
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    for name in chosen:
        ours = CLIENTS[name](dist.group.WORLD)
        theirs = CLIENTS[name](gloo)
        equal = len(ours) == len(theirs) and all(
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(ours, theirs, strict=False)
        )
        diff = max(
            ((a.float() - b.float()).abs().max().item() for a, b in zip(ours, theirs, strict=False) if a.numel()),
            default=0.0,
        )
        print(
            f"rank {rank} of {size}: client {name}: bit-equal to gloo: {equal} (max |diff| {diff:.3g}, "
            f"{len(ours)} tensors)",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # torch 2.13's Gloo sometimes aborts in its teardown at exit: the results are out


if __name__ == "__main__":
    main()
