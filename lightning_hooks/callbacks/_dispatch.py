"""Per-batch Lightning hooks a callback of ours does not define are not dispatched at all.

Lightning calls every per-batch hook of every callback (``trainer/call.py``:
``_call_callback_hooks``), each inside its profiler's context with an action name built for the
call, also when the hook is ``Callback``'s empty default: six such calls a training step per
callback. On a launch-bound step of about 11 ms on the CPU, six callbacks that do nothing cost
1.03x a bare step (``benchmarks/results/paired_launch.md``). Lightning skips an attribute that
is not callable (``if callable(fn)``, and Fabric's ``call`` one that is ``None``): for the fit,
each inherited per-batch hook of ours is shadowed by ``None`` on the instance, and the shadow is
removed when the fit ends. Hooks Lightning calls directly (``on_save_checkpoint``,
``on_load_checkpoint``) and every hook a class defines are left alone, as is an attribute
someone else set on the instance (a timing wrapper, say).
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl

__all__ = ["PER_BATCH_HOOKS", "restore_inherited", "skip_inherited"]

PER_BATCH_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
)
"""The hooks Lightning calls per batch through ``_call_callback_hooks``."""

_SHADOWED = "_lightning_hooks_shadowed"


def _namespaces() -> tuple[tuple[type, ...], dict[str, set[Any]]]:
    """The ``Trainer`` classes installed (two namespaces), and each hook's empty default in
    their ``Callback`` classes."""
    pairs: list[tuple[type, type]] = [(pl.Trainer, pl.Callback)]
    try:
        from lightning.pytorch import Callback as LightningCallback
        from lightning.pytorch import Trainer as LightningTrainer

        pairs.append((LightningTrainer, LightningCallback))
    except ImportError:
        pass
    defaults = {name: {getattr(base, name) for _, base in pairs} for name in PER_BATCH_HOOKS}
    return tuple(trainer for trainer, _ in pairs), defaults


_TRAINERS, _DEFAULTS = _namespaces()


def skip_inherited(callback: pl.Callback, trainer: Any) -> None:
    """Shadow ``callback``'s inherited per-batch hooks with ``None`` until
    :func:`restore_inherited`, when ``trainer`` is Lightning's, which then dispatches only the
    hooks the class defines (Fabric's loop in ``fabric_run.py`` calls ours by name: untouched)."""
    if not isinstance(trainer, _TRAINERS):
        return
    shadowed = []
    for name in PER_BATCH_HOOKS:
        if name not in callback.__dict__ and getattr(type(callback), name) in _DEFAULTS[name]:
            callback.__dict__[name] = None
            shadowed.append(name)
    callback.__dict__[_SHADOWED] = callback.__dict__.get(_SHADOWED, ()) + tuple(shadowed)


def restore_inherited(callback: pl.Callback) -> None:
    """Remove the shadows :func:`skip_inherited` set (idempotent)."""
    for name in callback.__dict__.pop(_SHADOWED, ()):
        if callback.__dict__.get(name, False) is None:
            del callback.__dict__[name]
