"""The hook registry: the one owner of every hook handle the library creates."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import Self

from lightning_hooks.core.selection import ModuleFilter, ModuleTypes, Patterns, select_modules

__all__ = ["HookOwner", "HookRegistry"]

ForwardHook = Callable[[nn.Module, Any, Any], Any]


class HookOwner:
    """Base of the core's trackers: each owns a :class:`HookRegistry` and is a context manager
    that removes every hook on exit, also when the loop raises."""

    registry: HookRegistry

    def remove(self) -> None:
        """Remove every hook (idempotent)."""
        self.registry.remove()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()


class HookRegistry(HookOwner):
    """Registers module, parameter and optimizer hooks and removes every one of them.

    Use it as a context manager in a plain PyTorch loop, or call :meth:`remove` (idempotent) from
    every exit path. Hooks placed on per-step tensors (activations) are not tracked: they die with
    the step's autograd graph.

    Cadence: forward hooks registered with ``gated=True`` run only while :attr:`sampled` is
    true; otherwise they return after one Python attribute read, dispatching no tensor op.
    Set :attr:`sampled` before a step's forward (``False``: skip the step).

    Args:
        model: the model whose modules :meth:`modules` selects from.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        >>> seen = []
        >>> with HookRegistry(model) as hooks:
        ...     for name, module in hooks.modules(types=nn.ReLU):
        ...         _ = hooks.forward_hook(module, lambda m, args, out: seen.append(out.shape))
        ...     _ = model(torch.zeros(4, 2))
        ...     len(hooks)
        1
        >>> seen, len(model[1]._forward_hooks)
        ([torch.Size([4, 3])], 0)
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._handles: list[RemovableHandle] = []
        self.sampled = True
        """Whether the current step is measured: gated hooks return at once when ``False``."""

    def modules(
        self,
        *,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
        where: ModuleFilter | None = None,
    ) -> list[tuple[str, nn.Module]]:
        """Select modules of the model; see :func:`~lightning_hooks.core.select_modules`."""
        return select_modules(
            self.model, types=types, include=include, exclude=exclude, where=where
        )

    def add(self, handle: RemovableHandle) -> RemovableHandle:
        """Take ownership of a handle created elsewhere."""
        self._handles.append(handle)
        return handle

    def forward_hook(
        self, module: nn.Module, hook: ForwardHook, *, gated: bool = False
    ) -> RemovableHandle:
        """``module.register_forward_hook(hook)``, owned by the registry.

        With ``gated``, the hook runs only on steps where :attr:`sampled` is true.
        """
        if gated:
            hook = self._gated(hook)
        return self.add(module.register_forward_hook(hook))

    def _gated(self, hook: ForwardHook) -> ForwardHook:
        def gated(module: nn.Module, args: Any, output: Any) -> Any:
            if self.sampled:
                return hook(module, args, output)
            return None

        return gated

    def forward_pre_hook(
        self, module: nn.Module, hook: Callable[[nn.Module, Any], Any]
    ) -> RemovableHandle:
        """``module.register_forward_pre_hook(hook)``, owned by the registry."""
        return self.add(module.register_forward_pre_hook(hook))

    def tensor_hook(
        self, tensor: torch.Tensor, hook: Callable[[torch.Tensor], torch.Tensor | None]
    ) -> RemovableHandle:
        """``tensor.register_hook(hook)`` on a long-lived tensor (a parameter), owned."""
        return self.add(tensor.register_hook(hook))  # type: ignore[no-untyped-call]

    def optimizer_step_post_hook(
        self, optimizer: torch.optim.Optimizer, hook: Callable[..., None]
    ) -> RemovableHandle:
        """``optimizer.register_step_post_hook(hook)``, owned by the registry."""
        return self.add(optimizer.register_step_post_hook(hook))

    def remove(self) -> None:
        """Remove every hook. Safe to call any number of times, also after the model is gone."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    @property
    def active(self) -> bool:
        """Whether the registry currently holds hooks."""
        return bool(self._handles)

    def __len__(self) -> int:
        return len(self._handles)
