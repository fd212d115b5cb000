"""The few ``torch.distributed`` facts the core needs; every function is a no-op in one process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_stacked",
    "all_reduce_sum_",
    "is_distributed",
    "mean_over_ranks",
    "rank",
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


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the ranks in place (one collective); returns it.

    Example:
        >>> all_reduce_sum_(torch.ones(2))  # one process: unchanged
        tensor([1., 1.])
    """
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def mean_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """The mean of ``tensor`` over the ranks, as a new float32 tensor on its device (one
    collective: a sum, then a division, as gloo has no average); ``tensor`` is left unchanged.

    Every rank of the default group must call it, in the same order as its other collectives.
    Like any ``all_reduce`` it does not block the host on CUDA.

    Example:
        >>> loss = torch.tensor(2.0, dtype=torch.bfloat16)
        >>> mean_over_ranks(loss)  # one process: a float32 copy
        tensor(2.)
    """
    out = tensor.detach().to(torch.float32, copy=True)
    if is_distributed() and dist.get_world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        out.div_(dist.get_world_size())
    return out


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
