"""The hook registry: the one owner of every hook handle the library creates.

It holds the gated hooks too, put on their modules only for logging steps.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import Self

from lightning_hooks import internals
from lightning_hooks.core import checks
from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.hooks.guard import Guard
from lightning_hooks.core.hooks.selection import ModuleFilter, ModuleTypes, Patterns, select_modules
from lightning_hooks.core.hooks.shared import shared_by
from lightning_hooks.core.hooks.suspended import outside_suspended
from lightning_hooks.errors import LightningHooksWarning

__all__ = ["Gated", "HookOwner", "HookRegistry", "StepArgs", "wrap_step_closure"]

ForwardHook = Callable[[nn.Module, Any, Any], Any]
F = TypeVar("F", bound=Callable[..., Any])
StepArgs = tuple[tuple[Any, ...], dict[str, Any]]
"""The arguments an optimizer step pre-hook gets and may return: ``(args, kwargs)``."""


def wrap_step_closure(
    args: tuple[Any, ...], kwargs: dict[str, Any], wrap: Callable[[Callable[[], Any]], Any]
) -> StepArgs | None:
    """Return an optimizer step's arguments with its closure replaced by ``wrap(closure)``.

    torch passes a step pre-hook the step's positional arguments with the optimizer first, so a
    closure given by position is the second; one given by keyword is ``kwargs["closure"]``.

    Args:
        args: the step's positional arguments, the optimizer first.
        kwargs: the step's keyword arguments.
        wrap: makes the closure the step runs from the one it was given.

    Returns:
        The arguments with the closure wrapped, or ``None`` where the step has no closure.
    """
    closure = kwargs.get("closure")
    if callable(closure):
        return args, {**kwargs, "closure": wrap(closure)}
    closure = args[1] if len(args) > 1 else None
    if callable(closure):
        return (args[0], wrap(closure), *args[2:]), kwargs
    return None


def _unhookable_modules(model: nn.Module) -> dict[int, str]:
    """Map ``id(module) -> name`` for every ``torch.jit`` module of ``model`` and what it holds."""
    jit = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)]
    return {id(inner): sub for name, m in jit for sub, inner in m.named_modules(prefix=name)}


class Gated:
    """A forward (pre-)hook put on its module for each logging step, and taken off after it.

    It is put on with ``register_forward_hook`` (or ``register_forward_pre_hook``), and taken
    off with its handle.

    Args:
        module: the module it hooks.
        hook: the hook, under the registry's guard.
        pre: a forward pre-hook (``True``) or a forward hook.
        options: ``prepend``, ``with_kwargs`` and, for a forward hook, ``always_call``: as
            torch's ``register_forward_hook`` takes them.
        source: the hook as its owner gave it (:meth:`HookRegistry.drop` finds it by this).
    """

    def __init__(
        self,
        module: nn.Module,
        hook: Callable[..., Any],
        *,
        pre: bool,
        options: dict[str, bool],
        source: Callable[..., Any] | None,
    ) -> None:
        self.module = module
        self.hook = hook
        self.pre = pre
        self.options = options
        self.source = source
        self.handle: RemovableHandle | None = None

    def install(self) -> RemovableHandle:
        """Put the hook on its module (once).

        Returns:
            The handle of the installed hook.
        """
        if self.handle is None:
            if self.pre:
                self.handle = self.module.register_forward_pre_hook(self.hook, **self.options)
            else:
                self.handle = self.module.register_forward_hook(self.hook, **self.options)
        return self.handle

    def uninstall(self) -> None:
        """Remove the hook from its module (idempotent)."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


_SAMPLED_RENAMED = (
    "HookRegistry.sampled is renamed logging_step: read registry.logging_step, and set it with "
    "registry.set_logging_step(...)"
)


class HookOwner:
    """Base of what puts hooks on a model: a context manager whose exit calls :meth:`remove`."""

    def remove(self) -> None:
        """Remove every hook; calling it again does nothing. Each owner defines it."""
        raise NotImplementedError(f"{type(self).__name__} defines no remove()")

    def __enter__(self) -> Self:
        """Enter the block: the hooks stay until it exits."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Remove every hook as the block exits, also on an exception."""
        self.remove()


@named_arguments
class HookRegistry(HookOwner):
    """Registers module and optimizer hooks and removes every one of them.

    A context manager (or call :meth:`remove` from every exit path). Hooks registered with
    ``gated=True`` run only while :attr:`logging_step` is true: installed and removed as it
    changes, except under ``torch.compile`` (a changing hook set recompiles).

    Args:
        model: the model whose modules :meth:`modules` selects from.
        guard: catches the hooks' exceptions (``None``: they propagate).

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

    def __init__(self, model: nn.Module, *, guard: Guard | None = None) -> None:
        self._model: nn.Module | None = checks.module("HookRegistry", "model", model)
        self._handles: list[RemovableHandle] = []
        self._gated_hooks: list[Gated] = []
        self.logging_step = True
        """Whether the gated hooks run: set by :meth:`set_logging_step` (a plain attribute to
        read, so that a quiet step calls nothing of the registry)."""
        self.fixed = internals.is_compiled(model)
        """Whether the gated hooks stay on the model at every step: under ``torch.compile``,
        adding or removing a hook would recompile the model, so they stay, and each checks
        :attr:`logging_step` itself."""
        self.guard = guard
        self.shared = shared_by(model)
        """What every registry on the model shares, whichever callback holds it."""
        self._unhookable = _unhookable_modules(model)
        self._names = {id(module): name for name, module in model.named_modules()}
        self._warned_unhookable = False

    @property
    def sampled(self) -> bool:
        """Deprecated: :attr:`logging_step`, as release 0.2.0 named it; setting it sets that."""
        warnings.warn(_SAMPLED_RENAMED, DeprecationWarning, stacklevel=2)
        return self.logging_step

    @sampled.setter
    def sampled(self, logging_step: bool) -> None:
        warnings.warn(_SAMPLED_RENAMED, DeprecationWarning, stacklevel=2)
        self.set_logging_step(bool(logging_step))

    def set_logging_step(self, logging_step: bool) -> None:
        """Put the gated hooks on for a logging step, or take them off after it.

        Under ``torch.compile`` they stay on: a changing hook set recompiles, and each checks
        :attr:`logging_step` itself.

        Args:
            logging_step: whether the coming step is a logging step.
        """
        changed = logging_step != self.logging_step
        self.logging_step = logging_step
        if not changed or self.fixed:
            return
        for gated in self._gated_hooks:
            if logging_step:
                gated.install()
            else:
                gated.uninstall()

    def gated_hook(
        self,
        module: nn.Module,
        hook: Callable[..., Any],
        *,
        pre: bool,
        source: Callable[..., Any] | None = None,
        **options: bool,
    ) -> RemovableHandle | None:
        """Register a gated forward (pre-)hook under the registry's guard.

        The hook runs as it is, inside any torch-function mode of the forward: a hook that
        measures goes through :meth:`forward_hook` or :meth:`forward_pre_hook`, which run it
        outside the library's own modes.

        Args:
            module: the module hooked.
            hook: the hook, wrapped by the registry's guard.
            pre: a forward pre-hook (``True``) or a forward hook.
            source: the hook as its owner gave it, for :meth:`drop`.
            **options: ``prepend``, ``with_kwargs`` and, for a forward hook, ``always_call``,
                as torch's ``register_forward_hook`` takes them.

        Returns:
            Its handle while installed, else ``None``.
        """
        where = self._forward_hook_name(module, pre)
        guarded = self._ours(self.guarded(hook, where))
        gated = Gated(module, guarded, pre=pre, options=options, source=source)
        self._gated_hooks.append(gated)
        if not (self.logging_step or self.fixed):
            return None
        return gated.install()

    @property
    def model(self) -> nn.Module:
        """The model, until :meth:`remove`.

        Raises:
            RuntimeError: the registry was removed.
        """
        if self._model is None:
            raise RuntimeError("HookRegistry: removed; it no longer holds the model")
        return self._model

    def modules(
        self,
        *,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
        where: ModuleFilter | None = None,
    ) -> list[tuple[str, nn.Module]]:
        """Select modules of the model, as :func:`~lightning_hooks.core.select_modules` does.

        ``torch.jit`` modules stay (their parameters can be measured) but get no module hook:
        one warning names them.

        Args:
            types: keep modules of these classes (``None``: any).
            include: qualified names or glob patterns to keep (``None``: all).
            exclude: qualified names or glob patterns to leave out.
            where: a test each kept module must pass.

        Returns:
            The selected ``(qualified name, module)`` pairs.
        """
        selected = select_modules(
            self.model, types=types, include=include, exclude=exclude, where=where
        )
        self._warn_unhookable([name for name, m in selected if id(m) in self._unhookable])
        return selected

    def _warn_unhookable(self, names: list[str]) -> None:
        """Warn once that the ``torch.jit`` modules ``names`` run no Python hooks."""
        if not names or self._warned_unhookable:
            return
        self._warned_unhookable = True
        owner = self.guard.name if self.guard is not None else type(self._model).__name__
        warnings.warn(
            f"{owner}: {len(names)} selected module(s) are torch.jit scripted or "
            f"traced and run no Python hooks; their forward statistics are skipped: "
            f"{', '.join(names[:10])}{' ...' if len(names) > 10 else ''}",
            LightningHooksWarning,
            stacklevel=4,
        )

    def hookable(self, module: nn.Module) -> bool:
        """Return whether ``module`` runs Python hooks.

        A ``torch.jit`` module runs none: one warning names those.

        Args:
            module: the module to be hooked.

        Returns:
            ``False`` for a ``torch.jit`` module (or one inside it), else ``True``.
        """
        if id(module) in self._unhookable:
            self._warn_unhookable(sorted(self._unhookable.values()))
            return False
        return True

    def _name(self, module: nn.Module) -> str:
        """Return ``module``'s qualified name in the model, else its class name."""
        return self._names.get(id(module)) or type(module).__name__

    def _forward_hook_name(self, module: nn.Module, pre: bool) -> str:
        """Return what the guard calls a forward (pre-)hook on ``module`` in its messages."""
        return f"forward {'pre-hook' if pre else 'hook'} on {self._name(module)!r}"

    def guarded(self, fn: F, where: str) -> F:
        """Wrap ``fn`` by the registry's guard, for hooks the registry does not own.

        Args:
            fn: the function to run under the guard.
            where: where ``fn`` runs, named in the guard's warning.

        Returns:
            ``fn`` wrapped, or ``fn`` itself without a guard.
        """
        return fn if self.guard is None else self.guard.wrap(fn, where)

    def _ours(self, hook: F) -> F:
        """Count ``hook`` among the library's hooks on the model (see :attr:`shared`)."""
        self.shared.hooks.add(hook)
        return hook

    def only_our_hooks(self, module: nn.Module) -> bool:
        """Return whether every forward (pre-)hook on ``module`` is one of the library's.

        A hook of the library's counts whichever callback put it there.

        Args:
            module: a module of the model.

        Returns:
            ``True`` if no other forward (pre-)hook is on ``module``.
        """
        ours = self.shared.hooks
        return all(hook in ours for hook in internals.forward_hooks(module))

    def plain_layers(self) -> Callable[[nn.Module], bool]:
        """Make the test of whether a module is a plain layer.

        A plain layer is a ``torch.nn`` leaf layer with no forward (pre-)hook but the library's.

        Returns:
            The test, for one module (always ``False`` under a global forward hook).
        """
        if internals.global_forward_hooks_installed():
            return lambda module: False

        def plain(module: nn.Module) -> bool:
            has_children = next(module.children(), None) is not None
            if has_children or not type(module).__module__.startswith("torch.nn.modules."):
                return False
            return self.only_our_hooks(module)

        return plain

    def _add(self, handle: RemovableHandle) -> RemovableHandle:
        """Own ``handle``: :meth:`remove` removes it. Return it."""
        self._handles.append(handle)
        return handle

    def forward_hook(
        self, module: nn.Module, hook: ForwardHook, *, gated: bool = False
    ) -> RemovableHandle | None:
        """Register ``module.register_forward_hook(hook)``, owned and guarded.

        Args:
            module: the module hooked.
            hook: the forward hook.
            gated: run the hook on logging steps only.

        Returns:
            Its handle (``None`` while a gated hook is off, and for a ``torch.jit`` module).
        """
        return self._forward(module, hook, gated, pre=False) if self.hookable(module) else None

    def forward_pre_hook(
        self,
        module: nn.Module,
        hook: Callable[..., Any],
        *,
        gated: bool = False,
        with_kwargs: bool = False,
    ) -> RemovableHandle | None:
        """Register ``module.register_forward_pre_hook(hook)``, as :meth:`forward_hook`.

        Args:
            module: the module hooked.
            hook: the forward pre-hook.
            gated: run the hook on logging steps only.
            with_kwargs: pass the forward's keyword arguments to the hook, as torch does.

        Returns:
            Its handle (``None`` while a gated hook is off, and for a ``torch.jit`` module).
        """
        if not self.hookable(module):
            return None
        return self._forward(module, hook, gated, pre=True, with_kwargs=with_kwargs)

    def _forward(
        self, module: nn.Module, hook: Callable[..., Any], gated: bool, pre: bool, **options: bool
    ) -> RemovableHandle | None:
        """Register a forward (pre-)hook, gated or not, owned and guarded."""
        # the caller checked hookable(): its warning's stack level counts from there
        if not gated:
            where = self._forward_hook_name(module, pre)
            register = module.register_forward_pre_hook if pre else module.register_forward_hook
            return self._add(register(self._ours(self.guarded(hook, where)), **options))

        def run(*args: object) -> object:
            if not self.logging_step:  # installed for good under torch.compile
                return None
            if not internals.function_mode_depth():  # no mode to step out of (most calls)
                return hook(*args)
            return outside_suspended(hook, *args)

        return self.gated_hook(module, run, pre=pre, source=hook, **options)

    def drop(self, hooks: Collection[Callable[..., Any]]) -> None:
        """Remove gated hooks from their modules for good.

        A hook that has nothing left to measure costs a logging step nothing. Under
        ``torch.compile`` they stay (a changed hook set recompiles).

        Args:
            hooks: the hooks, as given to :meth:`forward_hook` or :meth:`forward_pre_hook`.
        """
        if self.fixed or not hooks:
            return
        kept = []
        for gated in self._gated_hooks:
            if gated.source is not None and gated.source in hooks:
                gated.uninstall()
            else:
                kept.append(gated)
        self._gated_hooks = kept

    def optimizer_step_post_hook(
        self, optimizer: torch.optim.Optimizer, hook: Callable[..., None]
    ) -> RemovableHandle:
        """Register ``optimizer.register_step_post_hook(hook)``, owned and guarded.

        Args:
            optimizer: the optimizer hooked.
            hook: the step post-hook.

        Returns:
            Its handle.
        """
        hook = self.guarded(hook, "optimizer step post-hook")
        return self._add(optimizer.register_step_post_hook(hook))

    def optimizer_step_pre_hook(
        self,
        optimizer: torch.optim.Optimizer,
        hook: Callable[..., tuple[tuple[object, ...], dict[str, object]] | None],
    ) -> RemovableHandle:
        """Register ``optimizer.register_step_pre_hook(hook)``, owned and guarded.

        Args:
            optimizer: the optimizer hooked.
            hook: the step pre-hook, which may return the step's arguments changed.

        Returns:
            Its handle.
        """
        hook = self.guarded(hook, "optimizer step pre-hook")
        return self._add(optimizer.register_step_pre_hook(hook))

    def remove(self) -> None:
        """Remove every hook and drop the model (idempotent)."""
        self._model = None
        handles = self._handles
        gated = self._gated_hooks
        self._handles = []
        self._gated_hooks = []
        for handle in handles:
            handle.remove()
        for hook in gated:
            hook.uninstall()

    def __len__(self) -> int:
        """Count the hooks it holds, gated ones whether or not installed."""
        return len(self._handles) + len(self._gated_hooks)
