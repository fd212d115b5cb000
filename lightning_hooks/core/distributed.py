"""The process group's facts and collectives, which are no-ops in one process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

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

T = TypeVar("T")


def is_distributed() -> bool:
    """Return whether a default process group is up.

    Returns:
        ``True`` once one is (Lightning's DDP creates one in ``setup``).
    """
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Return this process's rank in the default group.

    Returns:
        The rank, ``0`` without a group.
    """
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Return the number of processes in the default group.

    Returns:
        The world size, ``1`` without a group.
    """
    return dist.get_world_size() if is_distributed() else 1


def group_device() -> torch.device:
    """Return the device of the default group's collectives.

    Returns:
        The current CUDA device under NCCL, else the CPU.
    """
    if is_distributed() and "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_group_device(tensor: torch.Tensor) -> torch.Tensor:
    """Copy ``tensor`` to the collectives' device.

    Args:
        tensor: the tensor to copy.

    Returns:
        ``tensor`` detached, as a new float32 tensor on :func:`group_device` (non-blocking).
    """
    device = group_device()
    return tensor.detach().to(device=device, dtype=torch.float32, non_blocking=True, copy=True)


def agree(flags: Sequence[bool]) -> list[int]:
    """Count how many ranks raise each flag.

    One small ``all_reduce`` read on the host (a host sync).

    Args:
        flags: this rank's flags, in the same order on every rank.

    Returns:
        For each flag, how many ranks raise it.
    """
    counts = torch.tensor([float(f) for f in flags], dtype=torch.float32, device=group_device())
    if is_distributed() and dist.get_world_size() > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return [int(c) for c in counts.tolist()]


def gather_objects(obj: T) -> list[T]:
    """Gather every rank's ``obj``, by rank: a one-off ``all_gather_object``.

    Args:
        obj: this rank's object (picklable).

    Returns:
        Each rank's object, by rank (``[obj]`` in one process).
    """
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()  # filled with each rank's
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the ranks in place (one collective).

    Args:
        tensor: the tensor summed in place.

    Returns:
        ``tensor``.
    """
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_stacked(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Gather every rank's ``tensor`` into one stacked tensor (one collective).

    Args:
        tensor: this rank's tensor, of the same shape on every rank.
        group: the process group gathered over (``None``: the default group).

    Returns:
        A ``[world_size, *tensor.shape]`` tensor: every rank's ``tensor``, by rank.
    """
    if not is_distributed():
        return tensor.unsqueeze(0)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)
