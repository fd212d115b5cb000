"""Parameters sharded by FSDP2 (``DTensor``): their shards, and partials made whole."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from lightning_hooks.core.distributed import all_gather_stacked

__all__ = ["Reduced", "ShardPlan", "combine_partials", "to_local"]

_DTENSOR: tuple[type, ...] = ()
try:  # public since torch 2.4; without it no parameter is a DTensor
    from torch.distributed.tensor import DTensor

    _DTENSOR = (DTensor,)
except ImportError:  # pragma: no cover - older torch
    pass


def to_local(tensor: torch.Tensor) -> torch.Tensor:
    """Return this rank's shard of a ``DTensor`` (a view, no copy, no collective).

    Args:
        tensor: a ``DTensor`` or a plain tensor.

    Returns:
        The local shard of a ``DTensor``, else ``tensor`` itself.
    """
    return tensor.to_local() if isinstance(tensor, _DTENSOR) else tensor  # type: ignore[attr-defined]


def combine_partials(gathered: torch.Tensor, num_sums: int) -> torch.Tensor:
    """Combine shard-local partials into whole values.

    Args:
        gathered: ``[shards, rows, columns]`` partials.
        num_sums: how many leading columns are summed; the others are maxed.

    Returns:
        A ``[rows, columns]`` tensor.
    """
    return torch.cat([gathered[..., :num_sums].sum(0), gathered[..., num_sums:].amax(0)], dim=-1)


class Reduced(NamedTuple):
    """What :meth:`ShardPlan.reduce` made whole: each tensor it was given, in order."""

    norms: list[torch.Tensor]
    sums: list[torch.Tensor]
    maxima: list[torch.Tensor]


@dataclass(frozen=True)
class ShardPlan:
    """The process group sharding every tracked parameter (FSDP2 ``DTensor``).

    Shard-local partials are made exact by one collective over it.

    Args:
        group: the process group.
        ranks: the group's global ranks.
    """

    group: dist.ProcessGroup | None = field(compare=False)
    ranks: tuple[int, ...]

    @classmethod
    def from_params(cls, params: Sequence[torch.Tensor]) -> ShardPlan | None:
        """Return the plan of ``params``.

        Args:
            params: the tracked parameters.

        Returns:
            Their plan, or ``None`` if none is a ``DTensor``.

        Raises:
            ValueError: the parameters are not sharded by FSDP2 over one process group (some are
                plain tensors, they use different groups, or their placements are not supported).
        """
        sharded = [isinstance(p, _DTENSOR) for p in params]
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

    def reduce(
        self,
        *,
        norms: Sequence[torch.Tensor] = (),
        sums: Sequence[torch.Tensor] = (),
        maxima: Sequence[torch.Tensor] = (),
    ) -> Reduced:
        """Make shard-local per-parameter values whole, in one collective.

        Args:
            norms: shard-local per-parameter L2 norms.
            sums: shard-local per-parameter sums.
            maxima: shard-local per-parameter maxima.

        Returns:
            Each tensor given, made whole, in order.
        """
        columns = [n.float().square() for n in norms] + [s.float() for s in sums]
        num_sums = len(columns)
        columns += [m.float() for m in maxima]
        packed = torch.stack(columns, dim=1)
        if len(self.ranks) > 1:
            packed = combine_partials(all_gather_stacked(packed, self.group), num_sums)
        out = list(packed.unbind(1))
        k = len(norms)
        return Reduced(
            norms=[n.sqrt() for n in out[:k]], sums=out[k:num_sums], maxima=out[num_sums:]
        )

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the shard group.

        Args:
            tensor: the shard-local tensor.

        Returns:
            The sum, a new tensor (``tensor`` itself where the group has one rank).
        """
        if len(self.ranks) == 1:
            return tensor
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out


def _plan_of(param: torch.Tensor) -> ShardPlan:
    """Return the plan of one ``DTensor`` parameter, or raise ``ValueError`` (not FSDP2 / HSDP)."""
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
    return ShardPlan(group=group, ranks=tuple(dist.get_process_group_ranks(group)))
