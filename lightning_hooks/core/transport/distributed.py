"""The few ``torch.distributed`` facts the core needs; every function is a no-op in one process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "agree",
    "all_gather_stacked",
    "all_reduce_sum_",
    "gather_objects",
    "group_device",
    "is_distributed",
    "rank",
    "to_group_device",
    "world_size",
]


def is_distributed() -> bool:
    """Whether a default process group is up (Lightning's DDP creates one in ``setup``)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default group, ``0`` without one."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The number of processes in the default group, ``1`` without one."""
    return dist.get_world_size() if is_distributed() else 1


def group_device() -> torch.device:
    """The device the default group's collectives take: the current CUDA device under NCCL,
    else the CPU (gloo, or no group).

    Example:
        >>> group_device()  # no process group
        device(type='cpu')
    """
    if is_distributed() and "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_group_device(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, as a new float32 tensor on :func:`group_device` (a CPU loss under
    NCCL, a CUDA loss under gloo); the copy is ``non_blocking``: no host sync.

    Example:
        >>> to_group_device(torch.tensor(2.0, dtype=torch.bfloat16))
        tensor(2.)
    """
    device = group_device()
    return tensor.detach().to(device=device, dtype=torch.float32, non_blocking=True, copy=True)


def agree(flags: Sequence[bool]) -> list[int]:
    """How many ranks raise each flag: one small ``all_reduce`` read on the host (a host sync:
    for logging steps and epoch ends, never a quiet step); each flag itself in one process.

    Example:
        >>> agree([True, False])
        [1, 0]
    """
    counts = torch.tensor([float(f) for f in flags], dtype=torch.float32, device=group_device())
    if is_distributed() and dist.get_world_size() > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return [int(c) for c in counts.tolist()]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), by rank: a one-off ``all_gather_object``.

    Example:
        >>> gather_objects("rank 0's")
        ["rank 0's"]
    """
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the ranks in place (one collective); returns it.

    Example:
        >>> all_reduce_sum_(torch.ones(2))  # one process: unchanged
        tensor([1., 1.])
    """
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_stacked(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``[world_size, *tensor.shape]``: every rank's ``tensor`` (one collective; same shapes).

    Example:
        >>> all_gather_stacked(torch.zeros(3)).shape
        torch.Size([1, 3])
    """
    if not is_distributed():
        return tensor.unsqueeze(0)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)
