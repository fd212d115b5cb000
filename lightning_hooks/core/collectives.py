"""Cross-rank reductions of packed statistics: one collective per tensor, none without a group."""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

__all__ = ["reduce_across_ranks"]


def reduce_across_ranks(tensor: torch.Tensor, op: Literal["sum", "max"]) -> torch.Tensor:
    """``tensor`` summed or max-ed over every rank (a new tensor); itself when not distributed.

    Example:
        >>> reduce_across_ranks(torch.tensor([1.0, 2.0]), "sum")
        tensor([1., 2.])
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    out = tensor.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return out
