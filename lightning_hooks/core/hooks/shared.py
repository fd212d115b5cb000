"""What the library's hooks on one model share, whichever callback put them there.

Which forward hooks on its modules are the library's, and the copies of small outputs its
statistics take. Every :class:`~.registry.HookRegistry` on a model finds the model's one
:class:`ModelShare` through :func:`shared_by`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from lightning_hooks import internals

__all__ = ["ModelShare", "Snapshots", "shared_by"]


class _Held(NamedTuple):
    """A tensor as a hook saw it, and a copy of it then."""

    tensor: torch.Tensor
    version: int  # its version counter when copied: an in-place op since bumps it
    copy: torch.Tensor


class Snapshots:
    """Copies of hooked outputs, one per tensor and version, for every hook that asks.

    The statistics watching one module (the activation statistics, their shape, the dead units,
    whichever callbacks hold them) each keep a copy of its small output for the step's end: every
    one after the first gets the first's while the tensor is unchanged (a copy is an op and an
    allocation per module and logging step).

    Example:
        >>> snapshots, x = Snapshots(), torch.ones(2)
        >>> first = snapshots.copy(x)
        >>> snapshots.copy(x) is first
        True
        >>> _ = x.add_(1)  # changed in place: a new copy
        >>> snapshots.copy(x) is first, snapshots.copy(x).tolist()
        (False, [2.0, 2.0])
    """

    def __init__(self) -> None:
        self._held: dict[int, _Held] = {}

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return a copy of ``tensor`` as it is now, out of autograd, made once for every caller.

        Args:
            tensor: a hooked output.

        Returns:
            The copy, shared with every caller while ``tensor`` is unchanged.
        """
        version = internals.tensor_version(tensor)
        held = self._held.get(id(tensor))
        if held is not None and held.tensor is tensor and held.version == version:
            return held.copy
        # a statistic's hook runs with grad disabled: its copy needs no detach (an op of its own)
        copy = tensor.detach().clone() if torch.is_grad_enabled() else tensor.clone()
        self._held[id(tensor)] = _Held(tensor=tensor, version=version, copy=copy)
        return copy

    def clear(self) -> None:
        """Drop every copy and its tensor (whoever took a copy keeps it)."""
        self._held = {}


class ModelShare:
    """What every registry on one model shares, for the model's life.

    Attributes:
        hooks: every forward (pre-)hook a registry put on the model's modules, whichever
            callback's: the attention capture tells a layer with only the library's hooks from
            one with a hook of the user's.
        snapshots: the copies of small outputs that the model's statistics take, one per tensor
            and version whichever callback holds the statistic.
    """

    def __init__(self) -> None:
        self.hooks: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
        self.snapshots = Snapshots()


_MODELS: weakref.WeakKeyDictionary[nn.Module, ModelShare] = weakref.WeakKeyDictionary()
"""One share per model, for the model's life: it spans the callbacks, and the fits, that hook
the model (a module-level registry for that reason)."""


def shared_by(model: nn.Module) -> ModelShare:
    """Return the share of ``model``, made at its first registry.

    Args:
        model: the root module a registry hooks.

    Returns:
        The one :class:`ModelShare` of ``model``.
    """
    share = _MODELS.get(model)
    if share is None:
        share = ModelShare()
        _MODELS[model] = share
    return share
