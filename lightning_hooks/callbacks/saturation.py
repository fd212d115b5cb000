"""``SaturationCallback``: how saturated the bounded activations (Sigmoid, Tanh, ...) are."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_hooks.callbacks._base import HookCallback, check_every_n_steps
from lightning_hooks.core import select_modules
from lightning_hooks.core.saturation import SATURATING_TYPES, SaturationStats, SaturationTracker
from lightning_hooks.core.selection import ModuleTypes, Patterns, as_patterns
from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.logging import log_scalars

__all__ = ["SaturationCallback"]


def _check_types(types: ModuleTypes) -> None:
    items = types if isinstance(types, tuple) else (types,)
    for t in items:
        if t is not None and not (isinstance(t, type) and issubclass(t, SATURATING_TYPES)):
            raise TypeError(
                f"SaturationCallback(types={types!r}): expected a subclass of one of "
                f"{[s.__name__ for s in SATURATING_TYPES]}, got {t!r}"
            )


class SaturationCallback(HookCallback):
    r"""Saturated outputs of every bounded activation, and units saturated all epoch long.

    A forward hook on every ``Sigmoid``, ``Tanh``, ``Softsign``, ``Hardtanh`` (``ReLU6`` included)
    and ``Hardsigmoid`` module counts, on the device and on every sampled training forward
    (``every_n_steps``), the outputs in the flat, near-zero-gradient region (thresholds in
    :func:`~lightning_hooks.core.saturation_mask`: ``|tanh| > 0.99``, sigmoid ``< 0.01`` or
    ``> 0.99``, Hardtanh exactly at ``min_val``/``max_val``, ...), and marks per *unit* (index along
    ``unit_dim``: a feature of a ``Linear``, a channel of a conv) whether any of its outputs was
    unsaturated. At each epoch end the counts are summed across ranks (one collective), copied to
    the host once and logged. A functional ``torch.tanh`` inside ``forward`` cannot be hooked: use
    the module.

    Warning rule (as for dead ReLUs): at each epoch end, on rank 0, one
    ``LightningHooksWarning`` per layer whose always-saturated fraction exceeds ``warn_above``,
    naming the layer and "k of n units".

    Logged metrics, per epoch (``{layer}``: the module's qualified name):

    ================================================  ==========================================
    Tag                                               Value, over the epoch's training forwards
    ================================================  ==========================================
    ``saturation/saturated_fraction/{layer}``         saturated outputs / outputs
    ``saturation/always_saturated_fraction/{layer}``  units never unsaturated / units
    ``saturation/global/saturated_fraction``          the same over every watched layer
    ``saturation/global/always_saturated_fraction``   the same over every watched unit
    ``saturation/global/layers``                      watched layers that ran (0: the model has
                                                      no bounded activation module)
    ================================================  ==========================================

    Args:
        types: the module types to watch (subclasses of the five above).
        include: glob patterns on qualified module names to keep.
        exclude: glob patterns on qualified module names to drop.
        unit_dim: the output dimension that indexes units (1: features of ``[N, F]``, channels
            of ``[N, C, H, W]``; use -1 for ``[N, T, F]`` sequences).
        margin: threshold margin of the smooth activations (0.01: ``|tanh| > 0.99``).
        warn_above: warn when more than this fraction of a layer's units is saturated on every
            sample of an epoch (``None``: never).
        every_n_steps: observe optimizer steps ``0, n, 2n, ...`` and each epoch's first step only;
            ``None`` (default): the Trainer's ``log_every_n_steps`` (50 unless set), 1: every step.
            Fractions are then over the sampled batches. Off-sample steps cost one Python attribute
            check per hook.

    Example:
        >>> callback = SaturationCallback(warn_above=0.25)
        >>> callback.warn_above
        0.25
    """

    def __init__(
        self,
        *,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
        unit_dim: int = 1,
        margin: float = 0.01,
        warn_above: float | None = 0.5,
        every_n_steps: int | None = None,
    ) -> None:
        _check_types(types)
        self.every_n_steps = check_every_n_steps("SaturationCallback", every_n_steps)
        if not 0 < margin < 0.5:
            raise ValueError(
                f"SaturationCallback(margin={margin}): must be in (0, 0.5), got {margin}"
            )
        if warn_above is not None and not 0 <= warn_above < 1:
            raise ValueError(
                f"SaturationCallback(warn_above={warn_above}): must be in [0, 1) or None, "
                f"got {warn_above}"
            )
        self.types = types
        self.include = as_patterns(include, "SaturationCallback(include=...)")
        self.exclude = as_patterns(exclude, "SaturationCallback(exclude=...)")
        self.unit_dim = unit_dim
        self.margin = margin
        self.warn_above = warn_above
        self.uses_images = False
        self._tracker: SaturationTracker | None = None

    @override
    def _validate(self, pl_module: pl.LightningModule) -> None:
        found = select_modules(
            pl_module,
            types=self.types or SATURATING_TYPES,
            include=self.include,
            exclude=self.exclude,
        )
        if not found:
            rank_zero_info(
                "SaturationCallback: the model has no Sigmoid, Tanh, Softsign, Hardtanh, ReLU6 or "
                "Hardsigmoid module to watch; saturation/global/layers will read 0."
            )

    @override
    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._tracker = SaturationTracker(
            pl_module,
            types=self.types,
            include=self.include,
            exclude=self.exclude,
            unit_dim=self.unit_dim,
            margin=self.margin,
        )

    @override
    def _log_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._tracker is None:
            return
        packed = self._tracker.packed()
        if trainer.world_size > 1:
            packed = trainer.strategy.reduce(packed.clone(), reduce_op="sum")
        stats = self._tracker.unpack(packed)
        self._tracker.reset()
        log_scalars(trainer.loggers, dict(_scalars(stats)), trainer.global_step)
        if self.warn_above is not None and trainer.is_global_zero:
            _warn(stats, trainer.current_epoch, self.warn_above)


def _warn(stats: SaturationStats, epoch: int, warn_above: float) -> None:
    for layer, fraction, k, n in zip(
        stats.layers,
        stats.always_saturated_fraction,
        stats.always_saturated,
        stats.units,
        strict=True,
    ):
        if fraction > warn_above:
            rank_zero_warn(
                f"SaturationCallback: layer {layer!r} has {k} of {n} units ({fraction:.0%}) "
                f"saturated on every training sample of epoch {epoch} (warn_above="
                f"{warn_above}); their gradients are near zero. Consider a smaller learning "
                "rate or weight init, normalization before the activation, or a "
                "non-saturating activation.",
                category=LightningHooksWarning,
            )


def _scalars(stats: SaturationStats) -> Iterator[tuple[str, float]]:
    ran = stats.entries > 0
    for layer, sat, always, active in zip(
        stats.layers, stats.saturated_fraction, stats.always_saturated_fraction, ran, strict=True
    ):
        if active:
            yield f"saturation/saturated_fraction/{layer}", float(sat)
            yield f"saturation/always_saturated_fraction/{layer}", float(always)
    if ran.any():
        entries, units = stats.entries[ran].sum(), stats.units[ran].sum()
        yield "saturation/global/saturated_fraction", float(stats.saturated[ran].sum() / entries)
        always = np.sum(stats.always_saturated[ran])
        yield "saturation/global/always_saturated_fraction", float(always / units)
    yield "saturation/global/layers", float(ran.sum())
