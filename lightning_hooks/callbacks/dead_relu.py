"""``DeadReLUCallback``: units that never fired in an epoch, per activation layer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_hooks.callbacks._base import HookCallback, check_every_n_steps
from lightning_hooks.callbacks._checks import check_types
from lightning_hooks.core.dead_units import RELU_FAMILY, DeadUnits, DeadUnitTracker
from lightning_hooks.core.selection import Patterns, as_patterns, select_modules
from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.logging import log_scalars

__all__ = ["DeadReLUCallback"]

_NAME = "DeadReLUCallback"


class DeadReLUCallback(HookCallback):
    r"""Dead units per activation layer: units that never fired on a sampled batch of an epoch.

    A unit is a channel of a conv output ``[N, C, ...]`` or a feature of a linear output ``[N, ...,
    F]``. A forward hook on each watched activation keeps, on the device, how often each unit fired
    in the epoch's sampled training forwards (``every_n_steps``; not validation, not the sanity
    check); a unit that never fired is dead (the keras-contrib ``DeadReluDetector`` definition). At
    each epoch end the counts are summed across ranks, copied to the host once and logged at
    ``trainer.global_step``.

    When a unit fires, per type (all of them keep the sign of their input, so the test reads
    the output, which also works for ``ReLU(inplace=True)``):

    ==========================================  ===========================================
    Module                                      Fired
    ==========================================  ===========================================
    ``ReLU``, ``ReLU6``                         output ``> 0`` (input ``> 0``)
    ``LeakyReLU`` (slope >= 0), ``ELU``         output ``> 0`` (input ``> 0``)
    ``GELU``, ``SiLU``                          output ``> 0`` (input ``> 0``)
    ``pre_activation`` layers (``F.relu``)      the layer's output ``> 0``
    ==========================================  ===========================================

    Logged metrics (``{layer}`` is the watched module's qualified name):

    ======================================  ===================================================
    Tag                                     Value, over the epoch's training forwards
    ======================================  ===================================================
    ``dead_relu/dead_fraction/{layer}``     units that never fired / units
    ``dead_relu/dead_count/{layer}``        units that never fired
    ``dead_relu/zero_fraction/{layer}``     fraction of outputs that did not fire, per batch,
                                            averaged over the epoch (ReLU: exact zeros)
    ======================================  ===================================================

    A ``LightningHooksWarning`` per layer and epoch, on rank 0, names the layer and "k of n
    units" when its dead fraction is ``>= threshold`` and at least one unit is dead. A module
    called twice in a forward is observed twice: a unit is alive if it fired in either call,
    and each call counts as one batch in ``zero_fraction``.

    Args:
        types: activation module types to watch (default: ``ReLU``, ``ReLU6``, ``LeakyReLU``,
            ``ELU``, ``GELU``, ``SiLU``).
        include: glob patterns on qualified module names to keep (among ``types``).
        exclude: glob patterns on qualified module names to drop.
        pre_activation: glob patterns of modules whose output feeds a functional activation
            (``F.relu(self.fc1(x))`` in ``forward``: ``pre_activation="fc1"``).
        threshold: dead fraction in ``[0, 1]`` at which a layer is warned about.
        warn: warn about dead layers at all.
        every_n_steps: observe optimizer steps ``0, n, 2n, ...`` and each epoch's first step only;
            ``None`` (default): the Trainer's ``log_every_n_steps`` (50 unless set), 1: every step.
            A unit is then dead when it fired on no sampled batch of the epoch (an upper bound on
            the every-step count). Off-sample steps cost one Python attribute check per hook.

    Example:
        >>> import pytorch_lightning as pl
        >>> callback = DeadReLUCallback(pre_activation="fc*", threshold=0.25)
        >>> trainer = pl.Trainer(callbacks=[callback])  # doctest: +SKIP
    """

    uses_images = False

    def __init__(
        self,
        *,
        types: type[nn.Module] | tuple[type[nn.Module], ...] = RELU_FAMILY,
        include: Patterns = None,
        exclude: Patterns = None,
        pre_activation: Patterns = None,
        threshold: float = 0.5,
        warn: bool = True,
        every_n_steps: int | None = None,
    ) -> None:
        check_types(_NAME, types)
        self.every_n_steps = check_every_n_steps(_NAME, every_n_steps)
        if isinstance(threshold, bool) or not isinstance(threshold, int | float):
            raise TypeError(
                f"{_NAME}(threshold={threshold!r}): must be a number, got {threshold!r}"
            )
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(
                f"{_NAME}(threshold={threshold!r}): must be in [0, 1], got {threshold!r}"
            )
        self.types = types
        self.include = as_patterns(include, f"{_NAME}(include=...)")
        self.exclude = as_patterns(exclude, f"{_NAME}(exclude=...)")
        self.pre_activation = as_patterns(pre_activation, f"{_NAME}(pre_activation=...)")
        self.threshold = float(threshold)
        self.warn = warn
        self._tracker: DeadUnitTracker | None = None

    @override
    def _state_key_fields(self) -> dict[str, Any]:
        return {**super()._state_key_fields(), "pre_activation": self.pre_activation}

    @override
    def _validate(self, pl_module: pl.LightningModule) -> None:
        found = select_modules(
            pl_module, types=self.types, include=self.include, exclude=self.exclude
        )
        if self.pre_activation:
            found += select_modules(pl_module, include=self.pre_activation)
        if not found:
            names = [getattr(t, "__name__", repr(t)) for t in _as_tuple(self.types)]
            raise ValueError(
                f"{_NAME}(types={names}, include={self.include!r}, exclude={self.exclude!r}): "
                "the model has no such module to watch; for a functional F.relu in forward, "
                "pass pre_activation= the layer that produces its input"
            )

    @override
    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._tracker = DeadUnitTracker(
            pl_module,
            types=self.types,
            include=self.include,
            exclude=self.exclude,
            pre_activation=self.pre_activation,
        )

    @override
    def _log_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._tracker is None:
            return
        result = self._tracker.result()
        self._tracker.reset()
        if not result.layers:
            return
        log_scalars(trainer.loggers, dict(_scalars(result)), trainer.global_step)
        if self.warn:
            self._warn_dead(result, trainer.current_epoch)

    def _warn_dead(self, result: DeadUnits, epoch: int) -> None:
        fractions = result.dead_fraction
        for layer, dead, units, fraction in zip(
            result.layers, result.dead, result.units, fractions, strict=True
        ):
            if dead > 0 and fraction >= self.threshold:
                rank_zero_warn(
                    f"{_NAME}: layer '{layer}' has {dead} of {units} units dead in epoch {epoch} "
                    f"(never fired on a sampled training batch; dead fraction {fraction:.3g} >= "
                    f"threshold {self.threshold:g})",
                    category=LightningHooksWarning,
                )


def _scalars(result: DeadUnits) -> Iterator[tuple[str, float]]:
    fractions = result.dead_fraction
    for i, layer in enumerate(result.layers):
        yield f"dead_relu/dead_fraction/{layer}", float(fractions[i])
        yield f"dead_relu/dead_count/{layer}", float(result.dead[i])
        yield f"dead_relu/zero_fraction/{layer}", float(result.zero_fraction[i])


def _as_tuple(types: type[nn.Module] | tuple[type[nn.Module], ...]) -> tuple[type[nn.Module], ...]:
    return types if isinstance(types, tuple) else (types,)
