"""How the gated hooks of sampled steps are put on, taken off, and run.

A :class:`Gated` hook is written into and deleted from its module's hook dicts under an id
reserved once, without a ``RemovableHandle`` per sampled step (it costs more than the hook's
call). The gated hooks' torch calls are never attention, so they run with the attention
capture's ``TorchFunctionMode`` popped (:func:`outside_shelved`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

__all__ = ["Gated", "GatedHandle", "ShelvedMode", "outside_shelved"]


class ShelvedMode(TorchFunctionMode):
    """A mode of this library that its gated hooks run outside of (:func:`outside_shelved`)."""


def outside_shelved(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, with the innermost torch-function mode popped while it runs when that mode
    is a :class:`ShelvedMode` (not while compiling: Dynamo traces the hook).

    Example:
        >>> seen = []
        >>> class Seen(ShelvedMode):
        ...     def __torch_function__(self, func, types, args=(), kwargs=None):
        ...         seen.append(func.__name__)
        ...         return func(*args, **(kwargs or {}))
        >>> with Seen():
        ...     _ = outside_shelved(torch.zeros, 1)  # not seen
        ...     _ = torch.ones(1)
        >>> seen
        ['ones']
    """
    if torch.compiler.is_compiling():
        return fn(*args)
    depth = torch._C._len_torch_function_stack()
    if not depth:
        return fn(*args)
    mode = torch._C._get_function_stack_at(depth - 1)
    if not isinstance(mode, ShelvedMode):
        return fn(*args)
    torch._C._pop_torch_function_stack()
    try:
        return fn(*args)
    finally:
        torch._C._push_on_torch_function_stack(mode)


class Gated(NamedTuple):
    """A module hook kept to be put on its module on each sampled step
    (:meth:`~lightning_hooks.core.hooks.registry.HookRegistry.gated_hook`).
    The hook dicts are looked up at each :meth:`install` (``__setstate__`` replaces them)."""

    module: nn.Module
    table: str  # the module's attribute holding the hooks
    flags: tuple[str, ...]  # its attributes where the id is marked (with_kwargs, always_call)
    key: int
    hook: Callable[..., Any]
    prepend: bool

    def install(self) -> None:
        """Put the hook on its module."""
        module, key = self.module, self.key
        hooks = getattr(module, self.table)
        hooks[key] = self.hook
        for flag in self.flags:
            getattr(module, flag)[key] = True
        if self.prepend:
            hooks.move_to_end(key, last=False)

    def uninstall(self) -> None:
        """Take the hook off its module (nothing if it is not on)."""
        module, key = self.module, self.key
        getattr(module, self.table).pop(key, None)
        for flag in self.flags:
            getattr(module, flag).pop(key, None)


class GatedHandle(RemovableHandle):
    """The handle of an installed :class:`Gated` hook: :meth:`remove` takes it off until it is
    installed again (its registry does so on the next sampled step unless it was removed)."""

    def __init__(self, gated: Gated) -> None:
        self.gated = gated
        self.id = gated.key
        self.hooks_dict_ref = weakref.ref(getattr(gated.module, gated.table))
        self.extra_dict_ref = tuple(weakref.ref(getattr(gated.module, f)) for f in gated.flags)

    def remove(self) -> None:
        """Take the hook off its module."""
        self.gated.uninstall()
