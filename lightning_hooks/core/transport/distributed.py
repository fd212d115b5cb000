"""``torch.distributed`` for the core: the facts of the process group it needs (no-ops in one
process), and exact per-parameter statistics of sharded (FSDP2 ``DTensor``) parameters: each
rank computes shard-local partials (sums of squares, sums, maxima) and ONE collective over the
shard group (not the HSDP replicas) combines them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "ShardPlan",
    "agree",
    "all_gather_stacked",
    "all_reduce_sum_",
    "combine_partials",
    "gather_objects",
    "group_device",
    "is_distributed",
    "is_sharded",
    "rank",
    "to_group_device",
    "to_local",
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
    """``tensor`` detached, as a new float32 tensor on :func:`group_device`, copied
    ``non_blocking`` (no host sync).

    Example:
        >>> to_group_device(torch.tensor(2.0, dtype=torch.bfloat16))
        tensor(2.)
    """
    device = group_device()
    return tensor.detach().to(device=device, dtype=torch.float32, non_blocking=True, copy=True)


def agree(flags: Sequence[bool]) -> list[int]:
    """How many ranks raise each flag: one small ``all_reduce`` read on the host (a host sync:
    logging steps and epoch ends only); each flag itself in one process.

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


_DTENSOR: tuple[type, ...] = ()
try:  # public since torch 2.4; without it no parameter is a DTensor
    from torch.distributed.tensor import DTensor

    _DTENSOR = (DTensor,)
except ImportError:  # pragma: no cover - older torch
    pass


def is_sharded(tensor: object) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a parameter or gradient under FSDP2).

    Example:
        >>> is_sharded(torch.ones(2))
        False
    """
    return isinstance(tensor, _DTENSOR)


def to_local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (a view, no copy, no collective); else ``tensor``.

    Example:
        >>> to_local(torch.ones(2))
        tensor([1., 1.])
    """
    return tensor.to_local() if is_sharded(tensor) else tensor  # type: ignore[attr-defined]


def combine_partials(gathered: torch.Tensor, num_sums: int) -> torch.Tensor:
    """Combine ``[shards, rows, columns]`` partials: the first ``num_sums`` columns are summed over
    the shards, the others max-ed (NaN propagates through both).

    Example:
        >>> shards = torch.tensor([[[9.0, 1.0]], [[16.0, 4.0]]])  # sum of squares | max, 2 shards
        >>> combine_partials(shards, num_sums=1)
        tensor([[25.,  4.]])
    """
    return torch.cat([gathered[..., :num_sums].sum(0), gathered[..., num_sums:].amax(0)], dim=-1)


@dataclass(frozen=True)
class ShardPlan:
    """The process group over which every tracked parameter is sharded, found once.

    Build it with :meth:`from_params` (``None`` when no parameter is a ``DTensor``). Supported,
    else ``ValueError``: every parameter sharded along the same one mesh dimension (FSDP2) and
    replicated along any other (HSDP).

    Attributes:
        group: the shard group.
        ranks: its global ranks.
    """

    group: Any = field(compare=False)
    ranks: tuple[int, ...]

    @classmethod
    def from_params(cls, params: Sequence[torch.Tensor]) -> ShardPlan | None:
        """The plan of ``params``, ``None`` if none is a ``DTensor``."""
        sharded = [is_sharded(p) for p in params]
        if not any(sharded):
            return None
        if not all(sharded):
            i = sharded.index(False)
            raise ValueError(
                "ShardPlan.from_params(params): every parameter must be a DTensor when one is "
                f"(apply fully_shard to the root module too); parameter {i} of shape "
                f"{tuple(params[i].shape)} is a plain tensor"
            )
        plans = {_plan_of(p) for p in params}
        if len(plans) > 1:
            raise ValueError(
                "ShardPlan.from_params(params): the parameters are sharded over different process "
                f"groups (ranks {sorted(p.ranks for p in plans)}); supported: one fully_shard mesh "
                "for the whole model"
            )
        return plans.pop()

    @property
    def size(self) -> int:
        """Number of shards."""
        return len(self.ranks)

    def reduce(
        self,
        *,
        norms: Sequence[torch.Tensor] = (),
        sums: Sequence[torch.Tensor] = (),
        maxima: Sequence[torch.Tensor] = (),
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Per-parameter shard-local L2 ``norms``, ``sums`` and ``maxima`` (each ``[P]``) made
        whole over the shard group in ONE collective (none for one rank); norms combine as sums
        of squares."""
        columns = [n.float().square() for n in norms] + [s.float() for s in sums]
        num_sums = len(columns)
        columns += [m.float() for m in maxima]
        packed = torch.stack(columns, dim=1)
        if self.size > 1:
            packed = combine_partials(all_gather_stacked(packed, self.group), num_sums)
        out = list(packed.unbind(1))
        k = len(norms)
        return [n.sqrt() for n in out[:k]], out[k:num_sums], out[num_sums:]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (counts of the local shard) summed over the shard group (a new tensor)."""
        if self.size == 1:
            return tensor
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out


def _plan_of(param: torch.Tensor) -> ShardPlan:
    """The shard group of one ``DTensor``: its only ``Shard`` mesh dimension."""
    placements = tuple(param.placements)  # type: ignore[attr-defined]
    mesh = param.device_mesh  # type: ignore[attr-defined]
    shard_dims = [d for d, p in enumerate(placements) if p.is_shard()]
    others = [p for p in placements if not (p.is_shard() or p.is_replicate())]
    if len(shard_dims) != 1 or others:
        raise ValueError(
            f"ShardPlan.from_params(params): a parameter of shape {tuple(param.shape)} has "
            f"placements {placements} on mesh {mesh}; supported: Shard along one mesh dimension "
            "(FSDP2 fully_shard), Replicate along the others (HSDP)"
        )
    group = mesh.get_group(shard_dims[0])
    return ShardPlan(group, tuple(dist.get_process_group_ranks(group)))
