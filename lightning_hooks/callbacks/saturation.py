"""The ``SaturationCallback``, which measures how saturated the bounded activations are."""

from __future__ import annotations

import numbers
from functools import partial
from typing import Any

from pytorch_lightning.utilities import rank_zero_warn
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import nn
from typing_extensions import override

from lightning_hooks.callbacks.attached import Logged
from lightning_hooks.callbacks.base import HookCallback
from lightning_hooks.callbacks.findings import Findings
from lightning_hooks.callbacks.trainer import TrainerView
from lightning_hooks.callbacks.watching import attach_stats, watches_selection
from lightning_hooks.core.checks import fraction_or_none, module_types, named_arguments, real
from lightning_hooks.core.hooks.guard import guarded
from lightning_hooks.core.hooks.selection import ModuleTypes, Patterns, as_patterns
from lightning_hooks.core.stats.saturation import (
    SATURATING_TYPES,
    SaturatedUnits,
    SaturationTracker,
)
from lightning_hooks.errors import LightningHooksWarning

__all__ = ["SaturationCallback"]


_WATCHES = (
    "bounded activation module (Sigmoid, Tanh, Softsign, Hardtanh, ReLU6, Hardsigmoid, or a "
    "Hugging Face or timm activation computing one)"
)


@named_arguments
class SaturationCallback(HookCallback):
    r"""Measures the saturated outputs of every bounded activation, and units saturated all epoch.

    Watches ``Sigmoid``, ``Tanh``, ``Softsign``, ``Hardtanh`` (``ReLU6`` included) and
    ``Hardsigmoid`` modules. Logged metrics, per epoch (``{layer}``: the module's qualified
    name); each logging step also logs all but ``always_saturated_fraction`` as ``{stat}_step``:

    ================================================  ==========================================
    Tag                                               Value, over the epoch's training forwards
    ================================================  ==========================================
    ``saturation/saturated_fraction/{layer}``         saturated outputs / outputs
    ``saturation/always_saturated_fraction/{layer}``  units never unsaturated / units
    ``saturation/global/saturated_fraction``          the same over every watched layer
    ``saturation/global/always_saturated_fraction``   the same over every watched unit
    ``saturation/global/layers``                      watched layers that ran
    ================================================  ==========================================

    Args:
        types: the module types to watch (subclasses of the five above).
        include: glob patterns on qualified module names to keep.
        exclude: glob patterns on qualified module names to drop.
        unit_dim: the output dimension that indexes units (1: features of ``[N, F]``, channels
            of ``[N, C, H, W]``; use -1 for ``[N, T, F]`` sequences).
        margin: threshold margin of the smooth activations (0.01: ``|tanh| > 0.99``).
        warn_at: warn about a layer when at least this fraction (in ``[0, 1]``) of its units is
            saturated on every sample of an epoch (0: any such unit), once per layer (repeats
            summed at the fit's end); ``None``: never.
        every_n_steps: measure optimizer steps ``n-1, 2n-1, ...`` and each epoch's first
            (``None``: the Trainer's ``log_every_n_steps``; 1: every step).

    Example:
        >>> callback = SaturationCallback(warn_at=0.25)
        >>> callback.warn_at
        0.25
    """

    def __init__(  # noqa: PLR0913 (a callback's public constructor: one keyword per option)
        self,
        *,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
        unit_dim: int = 1,
        margin: float = 0.01,
        warn_at: float | None = 0.5,
        every_n_steps: int | None = None,
    ) -> None:
        owner = type(self).__name__  # a subclass's own name, as the lifecycle's messages give
        module_types(owner, types, SATURATING_TYPES)
        dim: Any = unit_dim
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
            raise TypeError(f"{owner}(unit_dim={dim!r}): must be an int, got {dim!r}")
        unit_dim = int(dim)
        margin = real(owner, "margin", margin, low=0.0, high=0.5, low_open=True, high_open=True)
        self.warn_at = fraction_or_none(owner, "warn_at", warn_at)  # before selection errors
        include = as_patterns(include, f"{owner}(include={include!r})")
        exclude = as_patterns(exclude, f"{owner}(exclude={exclude!r})")
        tracker = SaturationTracker(
            types=types,
            include=include,
            exclude=exclude,
            owner=owner,
            unit_dim=unit_dim,
            margin=margin,
        )
        super().__init__(state_key={"stats": [tracker.config_key()]}, every_n_steps=every_n_steps)
        self.tracker = tracker
        """The saturation of each watched layer, attached afresh at each fit."""
        self.types = types
        self.include = include
        self.exclude = exclude
        self.unit_dim = unit_dim
        self.margin = margin

    @override
    def on_fit_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Check that the selection finds some activation of the model."""
        if self.lifecycle.watching:
            selected = {"types": self.types, "include": self.include, "exclude": self.exclude}
            self.lifecycle.watching = watches_selection(
                self.lifecycle.owner, pl_module, [self.tracker], what=_WATCHES, selected=selected
            )

    @override
    @guarded
    def on_train_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Hook the watched activations; each epoch's saturated units go to :meth:`_warn`."""
        if self.lifecycle.start_training():
            # The fit's own findings: its warnings, and the repeats summed up when it ends.
            findings = Findings(self.lifecycle.owner, "saturation findings")
            logged = [Logged(self.tracker, on_epoch=partial(self._warn, findings))]
            attached = attach_stats(
                pl_module, self.hook_guard(), logged, on_remove=findings.warn_held_back
            )
            self.lifecycle.attach(attached)

    @override
    @guarded
    def on_train_batch_start(
        self, trainer: TrainerView, pl_module: nn.Module, batch: Any, batch_idx: int
    ) -> None:
        """Put the module hooks on the model if the batch belongs to a logging step."""
        self.lifecycle.start_batch(trainer, batch_idx)

    @override
    @guarded
    def on_train_batch_end(
        self,
        trainer: TrainerView,
        pl_module: nn.Module,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Write a logging step once its optimizer step has run."""
        self.lifecycle.end_batch(trainer)

    @override
    @guarded
    def on_train_epoch_end(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Write the epoch's saturated units; their reader :meth:`_warn` warns past ``warn_at``."""
        self.lifecycle.end_epoch(trainer)

    def _warn(self, findings: Findings, trainer: TrainerView, found: SaturatedUnits) -> None:
        """Warn of each layer at or past ``warn_at``, once per layer per fit, on rank 0.

        Args:
            findings: the fit's findings, which say whether a layer was already warned about.
            trainer: the trainer whose epoch the warning names (only rank 0 warns).
            found: the epoch's units saturated on every sample, per layer.
        """
        epoch = trainer.current_epoch
        warn_at = self.warn_at
        if warn_at is None or not trainer.is_global_zero:
            return
        shares = found.always_saturated_fraction
        counts = found.always_saturated
        for layer, share, k, n in zip(found.layers, shares, counts, found.units, strict=True):
            if k > 0 and share >= warn_at and findings.first(layer):
                rank_zero_warn(
                    f"{self.lifecycle.owner}: layer {layer!r} has {k} of {n} units ({share:.0%}) "
                    f"saturated on every training sample of epoch {epoch} (warn_at="
                    f"{warn_at!r}); their gradients are near zero. Consider a smaller learning "
                    "rate or weight init, normalization before the activation, or a "
                    "non-saturating activation.",
                    category=LightningHooksWarning,
                )
