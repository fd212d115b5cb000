"""The guard: an error in one of our hooks disables that statistic, never the user's run."""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from functools import wraps
from typing import Any, Protocol, TypeVar

from lightning_hooks.errors import LightningHooksError, LightningHooksWarning

__all__ = [
    "GUARDED_HOOKS",
    "RELEASE_HOOKS",
    "STRICT_ENV",
    "Guard",
    "guard_hooks",
    "strict_default",
]

STRICT_ENV = "LIGHTNING_HOOKS_STRICT"  # ``1``: every guard strict (re-raises) unless told not
F = TypeVar("F", bound=Callable[..., Any])


def strict_default() -> bool:
    """Whether :data:`STRICT_ENV` is ``1``/``true``/``yes``/``on``."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class Guard:
    """Catches the exceptions of statistic ``name``'s hooks: the first marks it :attr:`failed`,
    warns once, and the owner removes its hooks at the next Lightning hook (with :attr:`defer`,
    once the ranks agree: :meth:`disable_on_every_rank`). A ``strict`` guard (default:
    :func:`strict_default`) re-raises, as every guard does for the library's own errors."""

    def __init__(self, name: str, *, strict: bool | None = None) -> None:
        self.name = name
        self.strict = strict_default() if strict is None else bool(strict)
        self.failed: str | None = None  # "where: ErrorType: message" of the first error
        self.pending = False  # a failure whose hooks the owner has not removed yet
        self.defer = False
        """Multi-process: a failure is kept in :attr:`local` until the ranks agree on it, so
        that every rank disables at the same step (:meth:`disable_on_every_rank`)."""
        self.local: str | None = None
        """This rank's failure, deferred until the ranks agree."""
        self.disabled_step: int | None = None
        """The step at which the ranks disabled the statistic, once agreed."""

    def fail(self, where: str, error: Exception) -> None:
        """Record ``error`` raised in ``where``: re-raise if strict or ours, else warn once."""
        if self.strict or isinstance(error, LightningHooksError):
            raise error
        if self.failed is not None or self.local is not None:
            return
        cause = f"{where}: {type(error).__name__}: {error}"
        if self.defer:
            self.local = cause
            return
        self.failed = cause
        self.pending = True
        self._warn(f"for the rest of the fit: its {where} raised {type(error).__name__}: {error}")

    def disable_on_every_rank(self, causes: Sequence[str | None], step: int, *, warn: bool) -> None:
        """Disable at ``step``: ``causes[r]`` is rank ``r``'s :attr:`local` (``None``: healthy);
        ``warn`` (rank 0): one warning naming each failure."""
        failed = [f"rank {r}: {cause}" for r, cause in enumerate(causes) if cause is not None]
        self.failed = "; ".join(failed)
        self.pending = True
        self.disabled_step = step
        if warn:
            self._warn(f"on every rank from step {step} for the rest of the fit: {self.failed}")

    def _warn(self, how: str) -> None:
        warnings.warn(
            f"{self.name} is disabled {how}. Training goes on without it; set {STRICT_ENV}=1 (or "
            "strict=True) to raise instead.",
            LightningHooksWarning,
            stacklevel=4,
        )

    def removal_due(self) -> bool:
        """``True`` once after a failure: the owner should remove the statistic's hooks now."""
        pending = self.pending
        self.pending = False
        return pending

    def wrap(self, fn: F, where: str) -> F:
        """``fn`` with its exceptions handled by :meth:`fail` (``fn`` itself when strict)."""
        if self.strict:
            return fn

        @wraps(fn)
        def guarded(*args: object, **kwargs: object) -> object:
            try:
                return fn(*args, **kwargs)
            except Exception as error:
                self.fail(where, error)
                return None

        return guarded  # type: ignore[return-value]


GUARDED_HOOKS = (
    "state_dict",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
)
"""The hooks :func:`guard_hooks` wraps, skipped once the statistic failed (not ``setup`` nor
``on_fit_start``: configuration errors must stop the fit). A failed ``state_dict`` returns
``None``: the checkpoint is saved without the callback's state, and a fit resumed from it starts
the callback's epoch afresh."""

RELEASE_HOOKS = ("on_train_end", "on_exception", "teardown")
"""The hooks that take the statistic's hooks off: :func:`guard_hooks` wraps them too, but they
run after a failure as well, so that every hook is removed whatever failed before. A failure in
one of them is reported like any other (in ``on_exception`` the user's exception goes on, not
ours)."""

_GUARDED: weakref.WeakSet[Callable[..., object]] = weakref.WeakSet()
"""The methods :func:`guard_hooks` made: a subclass that inherits one is not wrapped twice."""


class _GuardedOwner(Protocol):
    """What :func:`guard_hooks` needs of the class whose hooks it wraps (a callback)."""

    def hook_guard(self) -> Guard:
        """The guard of the statistic whose hooks run."""

    def _guard_disable(self) -> None:
        """Remove the statistic's hooks after a guarded failure."""


def guard_hooks(cls: type) -> None:
    """Wrap the :data:`GUARDED_HOOKS` and :data:`RELEASE_HOOKS` that ``cls`` defines: each runs
    under ``self.hook_guard()``; once it failed, calls ``self._guard_disable()`` once, and the
    guarded hooks do nothing more."""
    for name in (*GUARDED_HOOKS, *RELEASE_HOOKS):
        method = cls.__dict__.get(name)
        if method is not None and method not in _GUARDED:
            setattr(cls, name, _guarded_method(method, name, always=name in RELEASE_HOOKS))


def _guarded_method(
    method: Callable[..., object], name: str, *, always: bool
) -> Callable[..., object]:
    @wraps(method)
    def hook(self: _GuardedOwner, *args: object, **kwargs: object) -> object:
        guard = self.hook_guard()
        if always or guard.failed is None:
            try:
                return method(self, *args, **kwargs)
            except Exception as error:
                guard.fail(f"{name} hook", error)
        if guard.removal_due():
            self._guard_disable()
        return None

    _GUARDED.add(hook)
    return hook
