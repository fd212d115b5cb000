"""The torch-function modes of this library, and running outside them.

A mode of ours (the attention capture's) sees every torch call made while it is on torch's mode
stack. The calls of our own hooks and of ``torch.nn``'s plain layers are never what it looks
for, and each would cost a Python call of the mode: they run with the mode taken off the stack.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch.overrides import TorchFunctionMode

from lightning_hooks import internals

__all__ = ["SuspendableMode", "outside_suspended"]

R = TypeVar("R")


class SuspendableMode(TorchFunctionMode):
    """A mode of this library that its gated hooks run outside of.

    It can also be taken off for a whole module call: :meth:`suspend` as the module's first
    pre-hook and :meth:`resume` as its last hook (called always, on an exception too). The
    module's forward and every hook on it then run outside the mode.
    """

    def __init__(self) -> None:
        super().__init__()
        self._suspended: list[bool] = []  # per module call open: whether the mode was taken off

    def suspend(self, *_: object) -> None:
        """Forward pre-hook: take the mode off the stack, when it is the innermost."""
        if internals.is_compiling():  # a compiled region: the mode's stack is not touched
            return
        depth = internals.function_mode_depth()
        innermost = depth > 0 and internals.function_mode_at(depth - 1) is self
        if innermost:
            internals.pop_function_mode()
        self._suspended.append(innermost)

    def resume(self, *_: object) -> None:
        """Forward hook: put the mode back where :meth:`suspend` took it off.

        Raises:
            Exception: whatever failed in this library's own check; the mode is put back first,
                so that the stack is as it was before the module's call whatever the guard does.
        """
        try:
            compiling = internals.is_compiling()
        except Exception:
            self._put_back()
            raise
        if not compiling:
            self._put_back()

    def _put_back(self) -> None:
        """Push the mode again if the innermost open :meth:`suspend` took it off."""
        if self._suspended and self._suspended.pop():
            internals.push_function_mode(self)


def outside_suspended(fn: Callable[..., R], *args: object) -> R:
    """Call ``fn(*args)`` with an innermost :class:`SuspendableMode` popped (not while compiling).

    Args:
        fn: the function to call, a hook.
        *args: its arguments.

    Returns:
        What ``fn`` returns.
    """
    # The stack's depth first: one C call, and mostly zero (Dynamo reads it too).
    depth = internals.function_mode_depth()
    if not depth or internals.is_compiling():
        return fn(*args)
    mode = internals.function_mode_at(depth - 1)
    if not isinstance(mode, SuspendableMode):
        return fn(*args)
    internals.pop_function_mode()
    try:
        return fn(*args)
    finally:
        internals.push_function_mode(mode)
