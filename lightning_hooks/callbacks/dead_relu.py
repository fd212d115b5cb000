"""The ``DeadReLUCallback``, which counts, per layer, the units that never fired in an epoch."""

from __future__ import annotations

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
from lightning_hooks.core.checks import fraction_or_none, named_arguments
from lightning_hooks.core.hooks.guard import guarded
from lightning_hooks.core.hooks.selection import Patterns, as_patterns
from lightning_hooks.core.stats.dead_units import RELU_FAMILY, DeadUnits, DeadUnitTracker
from lightning_hooks.errors import LightningHooksWarning

__all__ = ["DeadReLUCallback"]

_WATCHES = (
    "ReLU-family activation module (ReLU, ReLU6, LeakyReLU, ELU, GELU, SiLU, or a Hugging Face or "
    "timm activation computing one)"
)
_FUNCTIONAL_HINT = (
    "; for a functional F.relu in forward, pass pre_activation= the layer that produces its input"
)


@named_arguments
class DeadReLUCallback(HookCallback):
    r"""Counts the dead units of each activation layer: those that never fired in an epoch.

    A dead unit fired on no logging step's batch of the epoch.

    A unit (a channel of ``[N, C, ...]``, a feature of ``[N, ..., F]``) fires when its output is
    ``> 0``. Logged metrics (``{layer}``: the module's qualified name), at each epoch end; each
    logging step also logs ``dead_relu/zero_fraction_step/{layer}``.

    ======================================  ===================================================
    Tag                                     Value, over the epoch's logging steps' forwards
    ======================================  ===================================================
    ``dead_relu/dead_fraction/{layer}``     units that never fired / units
    ``dead_relu/dead_count/{layer}``        units that never fired
    ``dead_relu/zero_fraction/{layer}``     fraction of outputs that did not fire, per batch,
                                            averaged over the epoch (ReLU: exact zeros)
    ======================================  ===================================================

    Args:
        types: activation module types to watch (default: ``ReLU``, ``ReLU6``, ``LeakyReLU``,
            ``ELU``, ``GELU``, ``SiLU``).
        include: glob patterns on qualified module names to keep (among ``types``).
        exclude: glob patterns on qualified module names to drop.
        pre_activation: glob patterns of modules whose output feeds a functional activation
            (``F.relu(self.fc1(x))`` in ``forward``: ``pre_activation="fc1"``).
        warn_at: warn about a layer whose dead fraction is ``>= warn_at`` (in ``[0, 1]``; 0:
            any dead unit), once per layer (repeats summed at the fit's end); ``None``: never.
        every_n_steps: measure optimizer steps ``n-1, 2n-1, ...`` and each epoch's first
            (``None``: the Trainer's ``log_every_n_steps``; 1: every step); a unit is dead if it
            fired on no logging step's batch.
        unit_dim: the output dimension that indexes units. ``None`` takes the last dimension
            of a 2-d or 3-d output (the features of ``[N, F]`` and ``[N, L, F]``) and dimension
            1 from 4-d (the channels of ``[N, C, H, W]``). Pass ``1`` after a ``Conv1d``
            (``[N, C, L]``), ``-1`` after a channels-last layer (``[N, H, W, C]``).

    Example:
        >>> import pytorch_lightning as pl
        >>> callback = DeadReLUCallback(pre_activation="fc*", warn_at=0.25)
        >>> trainer = pl.Trainer(callbacks=[callback])  # doctest: +SKIP
    """

    def __init__(  # noqa: PLR0913 (a callback's public constructor: one keyword per option)
        self,
        *,
        types: type[nn.Module] | tuple[type[nn.Module], ...] = RELU_FAMILY,
        include: Patterns = None,
        exclude: Patterns = None,
        pre_activation: Patterns = None,
        warn_at: float | None = 0.5,
        every_n_steps: int | None = None,
        unit_dim: int | None = None,
    ) -> None:
        owner = type(self).__name__  # a subclass's own name, as the lifecycle's messages give
        include = as_patterns(include, f"{owner}(include={include!r})")
        exclude = as_patterns(exclude, f"{owner}(exclude={exclude!r})")
        tracker = DeadUnitTracker(
            types=types,
            include=include,
            exclude=exclude,
            owner=owner,
            pre_activation=pre_activation,
            unit_dim=unit_dim,
        )
        self.warn_at = fraction_or_none(owner, "warn_at", warn_at)
        super().__init__(state_key={"stats": [tracker.config_key()]}, every_n_steps=every_n_steps)
        self.tracker = tracker
        """The dead units of each watched layer, attached afresh at each fit."""
        self.types = types
        self.include = include
        self.exclude = exclude
        self.pre_activation = tracker.producers.include
        self.unit_dim = unit_dim

    @override
    def on_fit_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Check that the selection finds some activation of the model."""
        if self.lifecycle.watching:
            selected = {
                "types": None if self.types == RELU_FAMILY else self.types,
                "include": self.include,
                "exclude": self.exclude,
                "pre_activation": self.pre_activation,
            }
            self.lifecycle.watching = watches_selection(
                self.lifecycle.owner,
                pl_module,
                [self.tracker],
                what=_WATCHES,
                selected=selected,
                hint=_FUNCTIONAL_HINT,
            )

    @override
    @guarded
    def on_train_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Hook the watched activations; each epoch's dead units go to :meth:`_warn`."""
        if self.lifecycle.start_training():
            # The fit's own findings: its warnings, and the repeats summed up when it ends.
            findings = Findings(self.lifecycle.owner, "dead-unit findings")
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
        """Write the epoch's dead units; their reader :meth:`_warn` warns past ``warn_at``."""
        self.lifecycle.end_epoch(trainer)

    def _warn(self, findings: Findings, trainer: TrainerView, found: DeadUnits) -> None:
        """Warn of each layer at or past ``warn_at``, once per layer per fit.

        Args:
            findings: the fit's findings, which say whether a layer was already warned about.
            trainer: the trainer whose epoch the warning names.
            found: the epoch's dead units per layer.
        """
        epoch = trainer.current_epoch
        warn_at = self.warn_at
        if warn_at is None:
            return
        rows = zip(found.layers, found.dead, found.units, found.dead_fraction, strict=True)
        for layer, dead, units, share in rows:
            if dead > 0 and share >= warn_at and findings.first(layer):
                rank_zero_warn(
                    f"{self.lifecycle.owner}: layer '{layer}' has {dead} of {units} units dead in "
                    f"epoch {epoch} (never fired on a logging step's batch; dead fraction "
                    f"{share:.3g} >= warn_at {warn_at:g})",
                    category=LightningHooksWarning,
                )
