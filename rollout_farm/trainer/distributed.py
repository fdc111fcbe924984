"""Data-parallel training with torch.distributed (gloo on the CPU, nccl when the trainer runs on GPUs: trainer.device).

Launch with torchrun; each process takes every world_size-th group of the step's batch:

    torchrun --nproc-per-node 2 -m rollout_farm.trainer.cli train ...

Each rank's loss is its share of the global loss (token sums over the *global* token count), and the
gradients are summed across ranks, so one step equals a single-process step on the whole batch
(tests/test_distributed.py checks the gradients match). Rank 0 alone talks to the service: it pulls the
step's rollouts and broadcasts them to the other ranks, and it pushes weights, evaluates and logs.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

DEVICE = torch.device("cpu")  # where collectives put their tensors: the trainer's device


def resolve_device(name: str) -> torch.device:
    """'auto': this process's GPU (LOCAL_RANK under torchrun) when CUDA is there, else the CPU; or 'cpu', 'cuda',
    'cuda:i'."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"trainer.device={name}: torch here has no CUDA device; use cpu or auto")
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


def init_from_env(device: torch.device = torch.device("cpu")) -> tuple[int, int]:
    """(rank, world_size); joins the process group (nccl on a GPU, gloo on the CPU) when launched by torchrun with
    WORLD_SIZE > 1."""
    global DEVICE
    DEVICE = device
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """x summed over ranks, in place."""
    if active():
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def sum_gradients(model: torch.nn.Module) -> None:
    """Sum every parameter's gradient across ranks (each rank's loss is already its share of the global one).

    Not DistributedDataParallel: its hooks all-reduce during backward, so a rank with no samples in a mini-batch
    (no backward pass) would leave the others waiting; it averages where the global-share losses need a sum; and
    micro-batches would need no_sync. One flat all-reduce after the mini-batch's backward passes does it all."""
    if not active():
        return
    for p in model.parameters():
        if p.requires_grad and p.grad is None:  # a rank with nothing in this mini-batch still takes part
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def broadcast_tensors(
    tensors: list[torch.Tensor] | None, shapes: list[tuple], dtypes: list[torch.dtype]
) -> list[torch.Tensor]:
    """Rank 0's tensors on every rank (the others pass None). Plain tensors only: nothing is pickled."""
    if not active():
        return tensors
    out = (
        [t.to(DEVICE) for t in tensors]
        if dist.get_rank() == 0
        else [torch.empty(s, dtype=d, device=DEVICE) for s, d in zip(shapes, dtypes)]
    )
    for t in out:
        dist.broadcast(t, src=0)
    return out


def broadcast_ints(values: list[int] | None, n: int) -> list[int]:
    if not active():
        return values
    t = torch.tensor(values if dist.get_rank() == 0 else [0] * n, dtype=torch.long, device=DEVICE)
    dist.broadcast(t, src=0)
    return t.tolist()


def barrier() -> None:
    if active():
        dist.barrier()
