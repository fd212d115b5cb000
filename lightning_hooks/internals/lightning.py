"""Every private attribute of Lightning the library touches (see :mod:`lightning_hooks.internals`).

Internals with no public path: a strategy's tensor-parallel size, the callbacks of a ``Fabric``,
the ``Fabric`` of a module it set up, the module and the optimizer inside Lightning's and
Fabric's wrappers, Fabric's gradient clipping observed before it clips, a logger's prefix, the
model's logging functions Lightning binds onto each callback, and the step Lightning logs an
epoch's metrics at. One speed-up with a public twin: the empty per-batch hooks a callback
inherits, skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from lightning_hooks.internals import speedups

__all__ = [
    "before_fabric_clips",
    "drop_model_logging",
    "fabric_callbacks",
    "fabric_wrapped_module",
    "is_set_up_by_fabric",
    "lightning_epoch_step",
    "logger_prefix",
    "shadow_hooks",
    "tensor_parallel_size",
    "unshadow_hooks",
    "unwrapped_optimizer",
]


def shadow_hooks(callback: object, names: Iterable[str]) -> tuple[str, ...]:
    """Speed-up: shadow the empty per-batch hooks a callback inherits, so Lightning skips them.

    Each of ``names`` is set to ``None`` on the instance, for one fit, so that Lightning does not
    call it; :func:`unshadow_hooks` takes the shadows off.

    Lightning calls every per-batch hook of every callback inside a profiler context, the empty
    defaults too, but skips an attribute that is not callable. On the launch-bound stand-in with
    the six callbacks at their defaults, calling the inherited hooks costs 65 us a step and
    shadowing them 13 us: 2.7% of a bare step (``benchmarks/speedups.py``).

    The public twin, with the speed-ups off (:func:`~lightning_hooks.internals.speedups`):
    nothing is shadowed, and Lightning calls the empty hooks.

    Args:
        callback: the callback whose inherited hooks are shadowed on its instance.
        names: the per-batch hooks it leaves empty; a hook the instance defines itself is kept.

    Returns:
        The hooks shadowed, for :func:`unshadow_hooks`.
    """
    if not speedups():
        return ()
    shadowed = tuple(name for name in names if name not in vars(callback))
    for name in shadowed:
        setattr(callback, name, None)
    return shadowed


def unshadow_hooks(callback: object, shadowed: Iterable[str]) -> None:
    """Take off the shadows :func:`shadow_hooks` set; calling it again does nothing.

    Args:
        callback: the callback whose shadowed hooks are restored to the ones it inherits.
        shadowed: the hooks :func:`shadow_hooks` returned.
    """
    for name in shadowed:
        if name in vars(callback) and getattr(callback, name) is None:
            delattr(callback, name)


def drop_model_logging(callback: object) -> None:
    """Drop the model's ``log`` and ``log_dict`` that Lightning binds onto a callback.

    Lightning's callback connector binds them onto every callback at a fit's start (an instance
    attribute each), and never takes them off. Without this, a callback would keep the model
    alive after the fit, through them.

    Args:
        callback: the callback whose bound ``log`` and ``log_dict`` are dropped.
    """
    for bound in ("log", "log_dict"):
        callback.__dict__.pop(bound, None)


def tensor_parallel_size(strategy: object) -> int:
    """Return a ``ModelParallelStrategy``'s tensor-parallel size (its ``_tensor_parallel_size``).

    Lightning keeps no public name for it. Without it, a tensor-parallel run, whose ranks see the
    same batch and shards of each activation, could not be refused: its per-layer statistics
    would be wrong.

    Args:
        strategy: the trainer's strategy.

    Returns:
        The tensor-parallel size, 1 for another strategy.
    """
    return int(getattr(strategy, "_tensor_parallel_size", 1))


def fabric_callbacks(fabric: object) -> list[Any] | None:
    """Return the list of callbacks a ``Fabric`` calls (its ``_callbacks``).

    Fabric keeps no public name for it. Without it, a callback could not put the object that
    drives it under Fabric in its own place, and ``fabric.call`` would hand it Fabric's
    arguments.

    Args:
        fabric: the ``Fabric`` whose callbacks are read.

    Returns:
        The list itself (changing it changes what Fabric calls), or ``None``.
    """
    callbacks: list[Any] | None = getattr(fabric, "_callbacks", None)
    return callbacks


def is_set_up_by_fabric(module: object) -> bool:
    """Return whether ``module`` is a ``LightningModule`` that a ``Fabric`` set up.

    It reads the module's ``_fabric``. Lightning keeps no public test of it. Without it, the loss
    of a Fabric loop, fed when the loop wants, would be read as an automatic optimization's.

    Args:
        module: the module the callback watches.

    Returns:
        Whether a ``Fabric`` set it up.
    """
    return getattr(module, "_fabric", None) is not None


def fabric_wrapped_module(module: Any) -> Any:  # noqa: ANN401 (any module, wrapped or not)
    """Return the user's module inside Fabric's wrapper (a ``_FabricModule``'s ``module``).

    Fabric keeps no public way to unwrap one. Without it, the callback would hook the wrapper,
    whose forward is not the user's, and name its layers ``_forward_module.*``.

    Args:
        module: a module, maybe wrapped by Fabric.

    Returns:
        The module inside the wrapper, else ``module`` itself.
    """
    inner = getattr(module, "module", None)
    return inner if type(module).__name__ == "_FabricModule" and inner is not None else module


def before_fabric_clips(
    strategy: object, method: str, argument: str, before: Callable[[Any, Any], None]
) -> Callable[[], None]:
    """Call ``before(optimizer, value)`` each time a Fabric strategy is about to clip.

    The method is ``strategy.<method>`` (a Fabric strategy's ``clip_gradients_norm`` or
    ``clip_gradients_value``), and ``value`` is its ``argument`` (the bound); the strategy's
    method is shadowed on the instance. Fabric has no hook before it clips. Without it, the
    gradient measured under ``fabric.clip_gradients`` would be the clipped one, not the one the
    model produced.

    Args:
        strategy: the Fabric's strategy.
        method: the name of its clipping method.
        argument: the name of that method's bound argument.
        before: called with the optimizer and the bound before each clip; it may raise (a
            refused set-up).

    Returns:
        A function that takes the shadow off, and only it: another callback's shadow over or
        under it stays. A shadow another one covers stays as a pass-through that calls nothing.
    """
    original = getattr(strategy, method)
    underneath = strategy.__dict__.get(method)  # another callback's shadow, or None
    observe: Callable[[Any, Any], None] | None = before

    def clip(module: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 (stands in for the strategy's clip method, whatever it takes and returns)
        if observe is not None:
            observe(optimizer, kwargs.get(argument, args[0] if args else None))
        return original(module, optimizer, *args, **kwargs)

    def take_off() -> None:
        nonlocal observe
        observe = None  # holds no callback from now on
        if strategy.__dict__.get(method) is clip:  # on top: what was under it comes back
            if underneath is None:
                strategy.__dict__.pop(method, None)
            else:
                setattr(strategy, method, underneath)

    setattr(strategy, method, clip)
    return take_off


def unwrapped_optimizer(optimizer: Any) -> Any:  # noqa: ANN401 (any optimizer, wrapped or not)
    """Return the torch optimizer inside Fabric's or Lightning's wrapper (its ``_optimizer``).

    Without it, an optimizer that Fabric hands to its clipping would not be recognized as the one
    the callback watches.

    Args:
        optimizer: an optimizer, maybe wrapped by Fabric or Lightning.

    Returns:
        The optimizer inside the wrapper, or ``optimizer`` itself.
    """
    return getattr(optimizer, "_optimizer", optimizer)


def logger_prefix(logger: object) -> str:
    """Return a Lightning logger's prefix (its ``_prefix``).

    Lightning keeps no public name for it. Without it, a logging step's scalars could be written
    without the prefix the logger's own ``log_metrics`` puts before each tag.

    Args:
        logger: the logger a logging step's scalars are written to.

    Returns:
        The prefix, ``""`` if none.
    """
    return str(getattr(logger, "_prefix", "") or "")


def lightning_epoch_step(trainer: object) -> int | None:
    """Return the step at which Lightning logs the metrics of the epoch that is ending.

    It is the Trainer's count of batches that stepped (``fit_loop.epoch_loop``'s
    ``_batches_that_stepped``), less one: read in ``on_train_epoch_end``, the step of the epoch's
    last batch that stepped. Lightning logs every metric at that count (``log_metrics``), and its
    fit loop lowers it by one around the epoch's metrics (``_FitLoop.on_advance_end``), so the
    epoch's ``self.log(..., on_epoch=True)`` and the validation run at the epoch's end land at
    this step. The count moves once per batch whose optimizer step ran, whatever
    ``log_every_n_steps``: under gradient accumulation once per accumulated step, under manual
    optimization once per batch. An epoch in which no batch stepped has the step of the epoch
    before it (-1 in the first), as Lightning's own.

    Lightning keeps no public name for it; every supported release has it (since 1.6.5), and
    Lightning's own ``LearningRateMonitor`` reads the same count. Without it, epoch values would
    be written at ``trainer.global_step - 1``, which is Lightning's step only where each batch
    that steps makes exactly one optimizer step: a manual optimization with two optimizers (a
    GAN) or none in a batch, or a batch the dataloader yields as ``None``, would put them apart.

    Args:
        trainer: the trainer whose epoch is ending.

    Returns:
        The step, or ``None`` for a trainer with no Lightning fit loop (the stand-in of a Fabric
        loop).
    """
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    stepped = getattr(epoch_loop, "_batches_that_stepped", None)
    return None if stepped is None else int(stepped) - 1
