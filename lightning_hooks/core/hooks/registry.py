"""The hook registry: the one owner of every hook handle the library creates, and its gated
hooks, put on their modules only for logging steps."""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Any, Literal, NamedTuple, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import Self

from lightning_hooks import internals
from lightning_hooks.core import checks
from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.hooks.guard import Guard, active_guard
from lightning_hooks.core.hooks.selection import ModuleFilter, ModuleTypes, Patterns, select_modules
from lightning_hooks.core.hooks.shelved import outside_shelved
from lightning_hooks.errors import LightningHooksWarning

__all__ = ["Gated", "HookOwner", "HookRegistry", "only_our_hooks", "plain_layers"]

ForwardHook = Callable[[nn.Module, Any, Any], Any]
F = TypeVar("F", bound=Callable[..., Any])

HookTable = Literal[
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
]
"""The names of a module's hook dicts: the hooks by id (``_forward_hooks``,
``_forward_pre_hooks``) and the ids marked for a hook option (the others)."""


def _hook_table(module: nn.Module, table: HookTable) -> OrderedDict[int, Any]:
    """``module``'s hook dict ``table``, by hook id: the one place this library reads a module's
    hooks. torch keeps no public view of them (a ``RemovableHandle`` only removes), and a gated
    hook is put on and taken off by its id, without the cost of registering a handle."""
    table_dict: OrderedDict[int, Any] = getattr(module, table)
    return table_dict


def _unhookable_modules(model: nn.Module) -> dict[int, str]:
    """``id(module) -> name`` of every ``torch.jit`` module and everything inside it."""
    jit = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)]
    return {id(inner): sub for name, m in jit for sub, inner in m.named_modules(prefix=name)}


class Gated(NamedTuple):
    """A hook put on its module for each logging step under an id reserved once (no handle)."""

    module: nn.Module
    table: HookTable  # the module's dict holding the hooks
    flags: tuple[HookTable, ...]  # its dicts where the id is marked (with_kwargs, always_call)
    key: int
    hook: Callable[..., Any]
    prepend: bool
    source: Callable[..., Any] | None = None
    """The hook as its owner gave it (:meth:`HookRegistry.drop` finds it by this)."""

    def install(self) -> None:
        """Put the hook on its module, marked with its options."""
        module, key = self.module, self.key
        hooks = _hook_table(module, self.table)
        hooks[key] = self.hook
        for flag in self.flags:
            _hook_table(module, flag)[key] = True
        if self.prepend:
            hooks.move_to_end(key, last=False)

    def uninstall(self) -> None:
        """Take the hook and its option marks off its module (idempotent)."""
        module, key = self.module, self.key
        _hook_table(module, self.table).pop(key, None)
        for flag in self.flags:
            _hook_table(module, flag).pop(key, None)


class _GatedHandle(RemovableHandle):
    """The handle of an installed :class:`Gated` hook, until the next logging step."""

    def __init__(self, gated: Gated) -> None:
        self.gated = gated
        self.id = gated.key
        self.hooks_dict_ref = weakref.ref(_hook_table(gated.module, gated.table))
        self.extra_dict_ref = tuple(weakref.ref(_hook_table(gated.module, f)) for f in gated.flags)

    def remove(self) -> None:
        self.gated.uninstall()


_OURS: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()  # every registry's module hooks


def _ours(hook: F) -> F:
    _OURS.add(hook)
    return hook


def plain_layers() -> Callable[[nn.Module], bool]:
    """Whether a module is a ``torch.nn`` leaf layer with no forward (pre-)hook but ours."""
    if internals.global_forward_hooks_installed():
        return lambda module: False

    def plain(module: nn.Module) -> bool:
        has_children = next(module.children(), None) is not None
        if has_children or not type(module).__module__.startswith("torch.nn.modules."):
            return False
        return only_our_hooks(module)

    return plain


def only_our_hooks(module: nn.Module) -> bool:
    """Whether every forward (pre-)hook on ``module`` is one of this library's."""
    hooks = (
        *_hook_table(module, "_forward_hooks").values(),
        *_hook_table(module, "_forward_pre_hooks").values(),
    )
    return all(hook in _OURS for hook in hooks)


class HookOwner:
    """Base of the core's trackers: a context manager that removes its registry's hooks."""

    registry: HookRegistry

    def remove(self) -> None:
        """Remove every hook (idempotent)."""
        self.registry.remove()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


@named_arguments
class HookRegistry(HookOwner):
    """Registers module and optimizer hooks and removes every one of them.

    A context manager (or call :meth:`remove` from every exit path). Hooks registered with
    ``gated=True`` run only while :attr:`logging_step` is true: installed and removed as it
    changes, except under ``torch.compile`` (a changing hook set recompiles).

    Args:
        model: the model whose modules :meth:`modules` selects from.
        guard: catches the hooks' exceptions (default: the running callback hook's guard).

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
        self.__dict__["logging_step"] = True  # (see logging_step)
        self.fixed = internals.is_compiled(model)  # the gated hooks stay installed (torch.compile)
        self.guard = guard if guard is not None else active_guard()
        self._unhookable = _unhookable_modules(model)
        self._names = {id(module): name for name, module in model.named_modules()}
        self._warned_unhookable = False

    logging_step: bool
    """Whether the gated hooks run; setting it puts them on or takes them off (a plain attribute
    to read: a quiet step calls nothing of the registry)."""

    def __setattr__(self, name: str, value: object) -> None:
        if name != "logging_step":
            object.__setattr__(self, name, value)
            return
        value = bool(value)
        changed, self.__dict__["logging_step"] = value != self.logging_step, value
        if not changed or self.fixed:
            return
        # Inline, both ways (the dicts read as _hook_table does): no frame of ours per hook.
        if value:
            for gated in self._gated_hooks:
                module, key = gated.module, gated.key
                hooks = getattr(module, gated.table)
                hooks[key] = gated.hook
                for flag in gated.flags:
                    getattr(module, flag)[key] = True
                if gated.prepend:
                    hooks.move_to_end(key, last=False)
            return
        for gated in self._gated_hooks:
            module, key = gated.module, gated.key
            getattr(module, gated.table).pop(key, None)
            for flag in gated.flags:
                getattr(module, flag).pop(key, None)

    def gated_hook(
        self,
        module: nn.Module,
        hook: Callable[..., Any],
        *,
        pre: bool,
        source: Callable[..., Any] | None = None,
        **options: bool,
    ) -> RemovableHandle | None:
        """A gated forward (pre-)hook under the registry's guard; its handle while installed,
        else ``None`` (``source``: the hook as its owner gave it, for :meth:`drop`).

        The hook runs as it is, inside any torch-function mode of the forward: a hook that
        measures goes through :meth:`forward_hook` or :meth:`forward_pre_hook`, which run it
        outside the library's own modes."""
        where = f"forward {'pre-hook' if pre else 'hook'} on {self._name(module)!r}"
        hook = self.guarded(hook, where)
        key = RemovableHandle.next_id  # an id no handle takes
        RemovableHandle.next_id += 1
        table: HookTable = "_forward_pre_hooks" if pre else "_forward_hooks"
        flags: list[HookTable] = []
        if options.get("with_kwargs"):
            flags.append("_forward_pre_hooks_with_kwargs" if pre else "_forward_hooks_with_kwargs")
        if options.get("always_call") and not pre:
            flags.append("_forward_hooks_always_called")
        gated = Gated(
            module=module,
            table=table,
            flags=tuple(flags),
            key=key,
            hook=_ours(hook),
            prepend=bool(options.get("prepend")),
            source=source,
        )
        self._gated_hooks.append(gated)
        if not (self.logging_step or self.fixed):
            return None
        gated.install()
        return _GatedHandle(gated)

    @property
    def model(self) -> nn.Module:
        """The model, until :meth:`remove` (then ``RuntimeError``)."""
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
        """:func:`~lightning_hooks.core.select_modules` of the model; ``torch.jit`` modules stay
        (their parameters can be measured) but get no module hook: one warning names them."""
        selected = select_modules(
            self.model, types=types, include=include, exclude=exclude, where=where
        )
        self._warn_unhookable([name for name, m in selected if id(m) in self._unhookable])
        return selected

    def _warn_unhookable(self, names: list[str]) -> None:
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
        """Whether ``module`` runs Python hooks (not ``torch.jit``: one warning names those)."""
        if id(module) in self._unhookable:
            self._warn_unhookable(sorted(self._unhookable.values()))
            return False
        return True

    def _name(self, module: nn.Module) -> str:
        return self._names.get(id(module)) or type(module).__name__

    def guarded(self, fn: F, where: str) -> F:
        """``fn`` wrapped by the registry's guard, for hooks the registry does not own."""
        return fn if self.guard is None else self.guard.wrap(fn, where)

    def _add(self, handle: RemovableHandle) -> RemovableHandle:
        self._handles.append(handle)
        return handle

    def forward_hook(
        self, module: nn.Module, hook: ForwardHook, *, gated: bool = False
    ) -> RemovableHandle | None:
        """``module.register_forward_hook(hook)``, owned and guarded (``gated``: on logging steps
        only); ``None`` for a ``torch.jit`` module."""
        return self._forward(module, hook, gated, pre=False) if self.hookable(module) else None

    def forward_pre_hook(
        self,
        module: nn.Module,
        hook: Callable[..., Any],
        *,
        gated: bool = False,
        with_kwargs: bool = False,
    ) -> RemovableHandle | None:
        """``module.register_forward_pre_hook``, as :meth:`forward_hook`."""
        if not self.hookable(module):
            return None
        return self._forward(module, hook, gated, pre=True, with_kwargs=with_kwargs)

    def _forward(
        self, module: nn.Module, hook: Callable[..., Any], gated: bool, pre: bool, **options: bool
    ) -> RemovableHandle | None:
        # the caller checked hookable(): its warning's stack level counts from there
        if not gated:
            where = f"forward {'pre-hook' if pre else 'hook'} on {self._name(module)!r}"
            register = module.register_forward_pre_hook if pre else module.register_forward_hook
            return self._add(register(_ours(self.guarded(hook, where)), **options))

        def run(*args: object) -> object:
            if not self.logging_step:  # installed for good under torch.compile
                return None
            if not internals.function_mode_depth():  # no mode to step out of (most calls)
                return hook(*args)
            return outside_shelved(hook, *args)

        return self.gated_hook(module, run, pre=pre, source=hook, **options)

    def drop(self, hooks: Collection[Callable[..., Any]]) -> None:
        """Take the gated ``hooks`` (as given to :meth:`forward_hook` or
        :meth:`forward_pre_hook`) off their modules for good: a hook that has nothing left to
        measure costs a logging step nothing. Under ``torch.compile`` they stay (a changed hook
        set recompiles)."""
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
        """``optimizer.register_step_post_hook(hook)``, owned and guarded."""
        hook = self.guarded(hook, "optimizer step post-hook")
        return self._add(optimizer.register_step_post_hook(hook))

    def remove(self) -> None:
        """Remove every hook and drop the model (idempotent)."""
        self._model = None
        handles, gated = self._handles, self._gated_hooks
        self._handles, self._gated_hooks = [], []
        for handle in handles:
            handle.remove()
        for hook in gated:
            hook.uninstall()

    def __len__(self) -> int:
        """The hooks it holds, gated ones whether or not installed."""
        return len(self._handles) + len(self._gated_hooks)
