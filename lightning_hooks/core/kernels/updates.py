"""The typical size of an optimizer step's update, read from a fixed sample of each tensor."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["typical_update"]

_TYPICAL_SAMPLE = 1024  # entries read per tensor by typical_update


@torch.no_grad()
def typical_update(
    before: Sequence[torch.Tensor],
    after: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """The median ``|after - before|`` over a fixed strided sample of up to about 1,024 entries
    of each tensor (a device scalar; no host sync): the size of a typical coordinate's update,
    which an adaptive optimizer's poisoned second moment shrinks even where a few unpoisoned
    coordinates keep the update's norm up. With ``grads`` (the gradients the step applied), only
    entries whose gradient is not zero count: a dead unit's weights stop moving by design.

    Example:
        >>> typical_update([torch.zeros(3)], [torch.tensor([1.0, -2.0, 3.0])])
        tensor(2.)
        >>> typical_update([torch.zeros(3)], [torch.tensor([1.0, -2.0, 3.0])], [torch.eye(3)[0]])
        tensor(1.)
    """
    picks = []
    for i, (old, new) in enumerate(zip(before, after, strict=True)):
        stride = max(1, new.numel() // _TYPICAL_SAMPLE)
        pick = torch.sub(new.flatten()[::stride], old.flatten()[::stride]).float().abs_()
        grad = None if grads is None else grads[i]
        if grad is not None:
            pick = pick.masked_fill_(grad.flatten()[::stride] == 0, torch.nan)
        elif grads is not None:  # no gradient at all: the tensor did not take part
            pick = pick.fill_(torch.nan)
        picks.append(pick)
    return torch.cat(picks).nanmedian()
