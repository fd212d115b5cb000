"""The typical size of an optimizer step's update, read from a fixed sample of each tensor."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_hooks.core.kernels.grouped_norms import SMALL

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
    groups: dict[tuple[object, ...], list[int]] = {}
    for i, (old, new) in enumerate(zip(before, after, strict=True)):
        grad = None if grads is None else grads[i]
        if _stackable(old, new, grad):  # small and plain: read with its shape's others
            kind = None if grad is None else grad.dtype
            groups.setdefault((new.shape, new.dtype, new.device, kind), []).append(i)
        else:
            flat = None if grad is None else grad.flatten()
            picks.append(_pick(old.flatten(), new.flatten(), flat, grads is not None))
    for rows in groups.values():
        old, new = (torch.stack([t[i] for i in rows]).flatten(1) for t in (before, after))
        got = None if grads is None else [grads[i] for i in rows]
        grad = None if got is None or got[0] is None else torch.stack(got).flatten(1)  # type: ignore[arg-type]
        picks.append(_pick(old, new, grad, grads is not None).flatten())
    return torch.cat(picks).nanmedian()


def _stackable(old: torch.Tensor, new: torch.Tensor, grad: torch.Tensor | None) -> bool:
    """Whether ``new`` is read in a stack: small (:data:`~.grouped_norms.SMALL`), dense, with
    its old copy and its gradient (if any) of its shape."""
    plain = type(new) is torch.Tensor and type(old) is torch.Tensor and not new.is_sparse
    if not plain or not 0 < new.numel() <= SMALL or old.shape != new.shape:
        return False
    return grad is None or (type(grad) is torch.Tensor and grad.shape == new.shape)


def _pick(
    old: torch.Tensor, new: torch.Tensor, grad: torch.Tensor | None, masked: bool
) -> torch.Tensor:
    """``|new - old|`` in float32 over every ``stride``-th entry along the last dimension (a
    flattened tensor, or a stack of same-shape ones flattened from the second), the stride
    making about :data:`_TYPICAL_SAMPLE` of them: NaN where ``grad`` is zero, and everywhere
    when ``masked`` and there is no gradient (the tensor did not take part)."""
    stride = max(1, new.shape[-1] // _TYPICAL_SAMPLE)
    pick = torch.sub(new[..., ::stride], old[..., ::stride]).float().abs_()
    if grad is not None:
        return pick.masked_fill_(grad[..., ::stride] == 0, torch.nan)
    return pick.fill_(torch.nan) if masked else pick
