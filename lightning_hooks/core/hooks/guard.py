"""The guard: an error in one of our hooks disables that callback, never the user's run."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from functools import wraps
from typing import Any, Protocol, TypeVar

from lightning_hooks.errors import LightningHooksError, LightningHooksWarning

__all__ = [
    "GUARDED_HOOKS",
    "RELEASE_HOOKS",
    "STRICT_ENV",
    "Guard",
    "guarded",
    "strict_default",
]

STRICT_ENV = "LIGHTNING_HOOKS_STRICT"  # ``1``: every guard strict (re-raises) unless told not
F = TypeVar("F", bound=Callable[..., Any])


def strict_default() -> bool:
    """Return whether guards are strict unless told otherwise.

    Returns:
        Whether :data:`STRICT_ENV` is ``1``/``true``/``yes``/``on``.
    """
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class Guard:
    """Catches the exceptions of the hooks of callback ``name``.

    The first exception marks it :attr:`failed`, warns once, and the owner removes its module
    hooks at the next Lightning hook. Under several processes (:attr:`defer`), the failure waits
    in :attr:`local` until the ranks agree (:meth:`disable_on_every_rank`), so that every rank
    disables the callback at the same step. A ``strict`` guard re-raises, as every guard does for
    the library's own errors.

    ```text
    one process:      healthy --error--> failed, removal pending --removal_due()--> removed
    several (defer):  healthy --error--> local --ranks agree--> failed, removal pending --> ...
    ```

    Args:
        name: the callback the warning names.
        strict: re-raise every exception (default: :func:`strict_default`).
    """

    def __init__(self, name: str, *, strict: bool | None = None) -> None:
        self.name = name
        self.strict = strict_default() if strict is None else bool(strict)
        self.failed: str | None = None  # "where: ErrorType: message" of the first error
        self.pending = False
        """A failure whose module hooks the owner has not removed yet (:meth:`removal_due`)."""
        self.defer = False
        """Multi-process: a failure is kept in :attr:`local` until the ranks agree on it, so
        that every rank disables at the same step (:meth:`disable_on_every_rank`)."""
        self.local: str | None = None
        """This rank's failure, deferred until the ranks agree."""
        self.disabled_step: int | None = None
        """The step at which the ranks disabled the callback, once agreed."""

    def fail(self, where: str, error: Exception) -> None:
        """Record ``error`` raised in ``where``: re-raise if strict or ours, else warn once.

        Args:
            where: the hook that raised, named in the warning.
            error: the exception raised.

        Raises:
            Exception: ``error`` itself, if the guard is strict, or the error is the library's
                own (:class:`LightningHooksError`), or, in one process, it is one of the
                library's warnings that the user's warning filter turned into an error: the user
                asked for it. Under several processes such a warning is raised on rank 0 alone,
                and an error on one rank would hang the others: it is a failure like any other,
                which the ranks agree on.
        """
        if self.strict or isinstance(error, LightningHooksError):
            raise error
        if isinstance(error, LightningHooksWarning) and not self.defer:
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
        """Disable the callback at ``step`` on every rank, once the ranks agreed.

        Args:
            causes: ``causes[r]`` is rank ``r``'s :attr:`local` (``None``: healthy).
            step: the step the callback is disabled at, named in the warning.
            warn: write one warning naming each failure (rank 0).
        """
        failed = [f"rank {r}: {cause}" for r, cause in enumerate(causes) if cause is not None]
        self.failed = "; ".join(failed)
        self.pending = True
        self.disabled_step = step
        if warn:
            self._warn(f"on every rank from step {step} for the rest of the fit: {self.failed}")

    def _warn(self, how: str) -> None:
        """Warn that the callback is disabled ``how`` (when, and why), and how to raise instead."""
        warnings.warn(
            f"{self.name} is disabled {how}. Training goes on without it; set {STRICT_ENV}=1 (or "
            "the callback's strict = True) to raise instead.",
            LightningHooksWarning,
            stacklevel=4,
        )

    def removal_due(self) -> bool:
        """Return whether the owner should remove the callback's hooks now.

        Returns:
            ``True`` once after a failure, then ``False``.
        """
        pending = self.pending
        self.pending = False
        return pending

    def wrap(self, fn: F, where: str) -> F:
        """Wrap ``fn`` so that its exceptions are handled by :meth:`fail`.

        Args:
            fn: the function to run under the guard.
            where: the name of ``fn`` the warning gives.

        Returns:
            ``fn`` wrapped (it returns ``None`` after a failure), or ``fn`` itself when strict.
        """
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
"""The hooks :func:`guarded` runs under the guard, skipped once the callback failed (not
``setup`` nor ``on_fit_start``: configuration errors must stop the fit). A failed ``state_dict``
returns ``None``: the checkpoint is saved without the callback's state, and a fit resumed from it
starts the callback's epoch afresh."""

RELEASE_HOOKS = ("on_train_end", "on_exception", "teardown")
"""The Lightning hooks that remove the callback's module hooks: :func:`guarded` runs them under the
guard too, but they run after a failure as well, so that every hook is removed whatever failed
before. A failure in one of them is reported like any other (in ``on_exception`` the user's
exception goes on, not ours)."""


class _GuardedOwner(Protocol):
    """What :func:`guarded` needs of the object whose hook it runs (a callback)."""

    def hook_guard(self) -> Guard:
        """Return the guard of the callback's hooks.

        Returns:
            The guard of the running fit.
        """

    def remove_hooks(self) -> None:
        """Remove the callback's module hooks from the model."""


def guarded(method: F) -> F:
    """Run a callback's Lightning hook under its guard.

    An exception is the guard's to handle (:meth:`Guard.fail`). Once the callback has failed,
    its module hooks are removed (``remove_hooks``), its Lightning hooks of
    :data:`GUARDED_HOOKS` return at once, and those of :data:`RELEASE_HOOKS` still run.

    Args:
        method: the hook, named as Lightning calls it.

    Returns:
        The hook under the guard.

    Example:
        >>> class Watcher:
        ...     guard = Guard("Watcher", strict=False)
        ...     def hook_guard(self): return self.guard
        ...     def remove_hooks(self): print("module hooks removed")
        ...     @guarded
        ...     def on_train_start(self): raise RuntimeError("ours")
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     Watcher().on_train_start()
        module hooks removed
    """
    name = method.__name__
    always = name in RELEASE_HOOKS

    @wraps(method)
    def hook(self: _GuardedOwner, *args: object, **kwargs: object) -> object:
        guard = self.hook_guard()
        if always or guard.failed is None:
            try:
                return method(self, *args, **kwargs)
            except Exception as error:
                guard.fail(f"{name} hook", error)
        if guard.removal_due():
            self.remove_hooks()
        return None

    hook.lightning_hooks_guarded = True  # type: ignore[attr-defined]
    return hook  # type: ignore[return-value]
