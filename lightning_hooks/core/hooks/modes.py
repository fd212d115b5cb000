"""Our hooks' own torch calls kept out of the attention capture's ``TorchFunctionMode``.

On a sampled step the attention capture holds a ``TorchFunctionMode`` over the whole training
forward, so every torch call inside it goes through the mode's Python, the statistics' hooks'
calls included (thousands per step with every callback on: a quarter of the sampled step's
cost on a small model). Those calls are never attention the capture records (it pauses the
running module while other hooks run), so every registry runs its gated hooks with such a mode
taken off the top of the torch-function stack, and puts it back after.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["ShelvedMode", "outside_shelved"]


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
