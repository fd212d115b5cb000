"""The ``GradFlowCallback``, which logs how gradients flow through every layer."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from pytorch_lightning.utilities import rank_zero_warn
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import nn
from torch.nn.parameter import is_lazy
from typing_extensions import override

from lightning_hooks.callbacks.alarm_actions import Action, check_actions
from lightning_hooks.callbacks.attached import Attached, Logged
from lightning_hooks.callbacks.base import HookCallback
from lightning_hooks.callbacks.grad_flow_alarms import AlarmsAcrossFits, FitAlarms
from lightning_hooks.callbacks.grad_flow_pictures import GradFlowPictures, observe_histograms
from lightning_hooks.callbacks.trainer import TrainerView, gradient_clipping, loss_scales
from lightning_hooks.callbacks.watching import nothing_to_watch, selection_state_key
from lightning_hooks.core import GradFlowTracker, LayerHistograms, LayerTable, checks
from lightning_hooks.core.alarms import AlarmRules
from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.hooks.guard import guarded
from lightning_hooks.core.hooks.selection import ModuleTypes, Patterns, Selection, as_patterns
from lightning_hooks.core.stats.alarm_feed import Measured
from lightning_hooks.core.stats.grad_flow import counts_the_model_itself, layers_of
from lightning_hooks.core.stats.stability import StabilityStats
from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.logging import save_loggers

__all__ = ["GradFlowCallback"]


@named_arguments
class GradFlowCallback(HookCallback):
    r"""Logs per-layer gradient flow at logging steps and raises early-warning alarms at every step.

    The gradient flow of a layer is the gradient applied to it, its weights and its updates.
    Layers, logging steps and notices are defined in docs/glossary.md. The alarms are the
    checks of :class:`~lightning_hooks.core.AlarmRules`, and they run on every optimizer step.

    Each epoch end logs the tags below, where ``{layer}`` is the module's qualified name, such
    as ``encoder.0``. At each logging step the ``grad_flow`` scalars, except the ``*_max`` peaks,
    are also logged under ``grad_flow/{stat}_step/{layer}``, with the alarm and notice counts
    under ``grad_flow/alarms_step/{rule}`` and ``grad_flow/notices_step/{name}``, and the
    ``stability`` scalars under ``stability/{stat}_step/{layer}``. Images and text are written
    only at epoch ends.

    ==========================================  ================================================
    Tag                                         Value at an epoch end, over its logging steps
    ==========================================  ================================================
    ``grad_flow/grad_norm/{layer}``             L2 norm of the gradient applied, mean
    ``grad_flow/grad_norm_max/{layer}``         the same, max
    ``grad_flow/grad_abs_mean/{layer}``         mean ``|g|`` over the layer's entries, mean
    ``grad_flow/grad_abs_max/{layer}``          max ``|g|`` over the layer's entries, max
    ``grad_flow/grad_nonfinite/{layer}``        steps with a NaN/Inf gradient entry, total
    ``grad_flow/weight_norm/{layer}``           L2 norm of the weights before the step, mean
    ``grad_flow/update_ratio/{layer}``          ``||w_after - w_before|| / ||w_before||``, mean
    ``grad_flow/update_ratio_max/{layer}``      the same, max
    ``grad_flow/output_grad_norm/{layer}``      L2 norm of d loss / d output, mean
    ``grad_flow/output_grad_norm_max/{layer}``  the same, max
    ``grad_flow/grad_norm_preclip/{layer}``     with clipping: the L2 norm before it, mean
    ``grad_flow/global/{stat}``                 the above, over all layers together
    ``grad_flow/global/grad_norm_postclip``     with clipping: the global ``grad_norm``, mean
    ``grad_flow/global/{stat}_p{q}``            beyond ``max_layers_logged`` layers: percentiles
    ``grad_flow/chart`` (image)                 mean and max ``|g|`` per layer, log scale
    ``grad_flow/heatmap`` (image)               ``heatmap=True``: norm per layer x epoch, log scale
    ``grad_flow/grad_log10_abs/{layer}``        ``histograms=True``: ``log10 |g|``, every step
    ``grad_flow/alarms/{rule}``                 alarms of the epoch that warned, per rule
    ``grad_flow/notices/{name}``                notices of the epoch (logged, never warned)
    ``grad_flow/alarms/text_summary`` (text)    one line per alarm: step, rule, layer, values
    ``stability/attn_logit_max/{layer}``        per attention module: largest pre-softmax logit
    ``stability/attn_entropy_min/{layer}``      the same: the smallest head's mean entropy
    ``stability/logit_logz/{layer}``            the output layer's ``logsumexp``, mean
    ``stability/logit_logz_max/{layer}``        the same, max
    ``stability/{stat}_step/{layer}``           each of the five at each logging step
    ==========================================  ================================================

    Args:
        types: only modules of these types count as layers. By default any module with
            parameters counts.
        include: glob patterns on qualified module names (``"encoder.*"``) to keep.
        exclude: glob patterns on qualified module names to drop.
        update_ratio: measure the update-to-weight ratio. This keeps one copy of the parameters.
        output_grad: measure the gradient with respect to each layer's output.
        chart: log the gradient-flow chart image each epoch.
        max_layers_logged: the most layers whose per-layer tags are logged each epoch. Layers
            with a non-finite gradient come first, then half the places go to the largest
            gradient norms (with an odd place) and half to the smallest. ``None`` logs every
            layer.
        histograms: log a histogram of ``log10 |g|`` per layer each epoch, over every optimizer
            step. This costs one more pass over the gradients at every step.
        heatmap: log, each epoch, an image of the gradient norm per layer and epoch.
        alarms: the alarm rules. ``True`` uses the defaults of :class:`AlarmRules`, and
            ``False`` turns the alarms off.
        on_alarm: what a rule does when it fires: ``"warn"``, ``"stop"`` the fit, ``"raise"``
            an error, ``"skip"`` the optimizer step, or ``"log"`` only. Give one action for
            every rule, or ``{rule: action}``, where a rule not named warns. The notices
            *spike* and *stall* are only logged, unless named or under ``"skip"``. A skipped
            step cannot cure the loss rules, *vanishing*, *stall* or *attention*, so for them
            ``"skip"`` warns.
        every_n_steps: measure on optimizer steps ``n-1, 2n-1, ...`` and on the first step of
            each epoch. ``None`` uses the Trainer's ``log_every_n_steps``. The alarms run on
            every step whatever this is.
        stability: log the instability statistics ``stability/...`` on the logging steps. They
            ignore ``types``, ``include`` and ``exclude``. The output layer they read is the
            last module, in forward order, that owns parameters and returns a floating tensor.

    Example:
        >>> import pytorch_lightning as pl
        >>> trainer = pl.Trainer(callbacks=[GradFlowCallback(exclude="*.bn*")])  # doctest: +SKIP
    """

    def __init__(  # noqa: PLR0913 (a callback's public constructor: one keyword per option)
        self,
        *,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
        update_ratio: bool = True,
        output_grad: bool = True,
        chart: bool = True,
        max_layers_logged: int | None = 100,
        histograms: bool = False,
        heatmap: bool = False,
        alarms: AlarmRules | bool = True,
        on_alarm: Action | Mapping[str, Action] = "warn",
        every_n_steps: int | None = None,
        stability: bool = True,
    ) -> None:
        # Every argument is checked first, so a bad one fails before anything is built.
        owner = type(self).__name__  # a subclass's own name, as the lifecycle's messages give
        checks.module_types(owner, types, (nn.Module,))
        include = as_patterns(include, f"{owner}(include={include!r})")
        exclude = as_patterns(exclude, f"{owner}(exclude={exclude!r})")
        max_layers_logged = checks.positive_int_or_none(
            owner, "max_layers_logged", max_layers_logged, none_means="every layer"
        )
        switches = {
            "update_ratio": update_ratio,
            "output_grad": output_grad,
            "chart": chart,
            "histograms": histograms,
            "heatmap": heatmap,
            "stability": stability,
        }
        for name, value in switches.items():
            checks.boolean(owner, name, value)
        rules = _alarm_rules(alarms, owner)
        actions = check_actions(on_alarm, owner)
        super().__init__(
            state_key=selection_state_key(types, include, exclude),
            every_n_steps=every_n_steps,
            uses_images=chart or heatmap,
            fabric_refusal=_refusal_under_fabric(actions, rules),
        )
        self.types = types
        self.include = include
        self.exclude = exclude
        self.update_ratio = update_ratio
        self.output_grad = output_grad
        self.chart = chart
        self.max_layers_logged = max_layers_logged
        self.histograms = histograms
        self.heatmap = heatmap
        self.alarms = rules
        self.on_alarm = actions
        """The action of each rule; a rule ``on_alarm`` did not name has its default."""
        self.stability = stability
        self._alarms_across_fits = AlarmsAcrossFits(rules, actions, owner)
        # The alarms carry their running scales to the next fit, and through checkpoints.
        across = self._alarms_across_fits
        self.lifecycle.checkpoint.keep("alarms", across, on_new_epoch=across.start_new_epoch)
        # Release 0.2.0 saved the tracker's state at the top of the callback's.
        self.lifecycle.checkpoint.upgrade_old_states_with(_upgrade_0_2_0_state)
        self._pictures = GradFlowPictures(max_layers_logged, chart=chart, heatmap=heatmap)
        # So that a resumed fit draws the earlier epochs.
        self.lifecycle.checkpoint.keep("heatmap", self._pictures.history)
        self._fit: _Fit | None = None

    @property
    def policy(self) -> FitAlarms | None:
        """Deprecated: release 0.2.0's alarm policy; now the running fit's alarms, which act.

        ``None`` between fits and under ``alarms=False``.
        """
        warnings.warn(
            f"{self.lifecycle.owner}.policy is deprecated: each fit has its own alarms, which act "
            "on them, and the actions are callback.on_alarm",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._alarms_across_fits.running

    @override
    def on_fit_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Check that the selection finds some layer, whose parameters are initialized."""
        if self.lifecycle.watching:
            self.lifecycle.watching = self._finds_layers(pl_module)

    def _finds_layers(self, pl_module: nn.Module) -> bool:
        """Return whether the selection finds some layer to measure in ``pl_module``.

        A selection at its defaults that finds none, or lazy parameters not yet initialized,
        warn once: the callback then does nothing in the fit.

        Raises:
            ValueError: the user's selection selects no layer.
        """
        selection = Selection.of(
            self.lifecycle.owner, types=self.types, include=self.include, exclude=self.exclude
        )
        modules = selection.modules(pl_module)
        owners = list(modules)  # the layers measured
        if counts_the_model_itself(self.types, self.include):
            owners.append(("", pl_module))
        lazy = [
            f"{name}.{param_name}" if name else param_name
            for name, module in owners
            for param_name, param in module.named_parameters(recurse=False)
            if is_lazy(param)
        ]
        if lazy:
            rank_zero_warn(
                f"{self.lifecycle.owner}: the selected layers' lazy parameters {lazy[:3]} are "
                "not initialized before fit; this callback does nothing in this fit. Initialize "
                "them first: one forward of a sample batch before trainer.fit (or in the "
                "LightningModule's setup)",
                category=LightningHooksWarning,
            )
            return False
        if not layers_of(pl_module, modules, types=self.types, include=self.include).layers:
            selected = {"types": self.types, "include": self.include, "exclude": self.exclude}
            return nothing_to_watch(
                self.lifecycle.owner, "module owning a parameter", selected=selected
            )
        return True

    @override
    @guarded
    def on_train_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Start the fit's heatmap, then attach the tracker, the optional statistics and the alarms.

        If a checkpoint is held for the fit, ``lifecycle.attach`` loads it, and with it the
        heatmap's columns.
        """
        if self.lifecycle.start_training():
            self._pictures.start()
            self.lifecycle.attach(self._attach(trainer, pl_module))

    def _attach(self, trainer: TrainerView, pl_module: nn.Module) -> Attached:
        """Attach the tracker, the optional statistics and the alarms for one fit.

        A layer that no optimizer steps triggers one warning that names it. The alarms start from
        the state the last fit left. If a step of the set-up fails (a warning raised as an error
        too), the module hooks already on the model are removed before the error goes on to the
        guard.
        """
        tracker = self._make_tracker(trainer, pl_module)
        try:
            unstepped = tracker.unstepped()
            if unstepped:  # warned once; raised as an error, the hooks are removed below
                rank_zero_warn(
                    f"{self.lifecycle.owner}: no optimizer of the Trainer steps the trainable "
                    f"parameters of {', '.join(repr(n) for n in unstepped)}; these layers are "
                    "not measured.",
                    category=LightningHooksWarning,
                )
            stability_stats = StabilityStats() if self.stability else None
            if stability_stats is not None:
                # On the tracker's registry: one switch turns both on at logging steps, and both
                # are removed together.
                stability_stats.attach(pl_module, tracker.registry)
            gradient_histograms = _histograms(tracker) if self.histograms else None
            # Last, so that nothing after it can fail: the alarms are running once started.
            fit_alarms = self._alarms_across_fits.start(
                trainer, pl_module, tracker, self.lifecycle.ranks
            )
        except BaseException:
            tracker.remove()
            raise
        fit = _Fit(
            tracker=tracker,
            alarms=_NoAlarms() if fit_alarms is None else fit_alarms,
            stability_stats=stability_stats,
            gradient_histograms=gradient_histograms,
        )
        self._fit = fit
        logged: list[Logged[Any]] = [Logged(tracker, on_epoch=self._draw_pictures)]
        if fit.stability_stats is not None:
            # The attention rule reads each logging step's values once they are on the host.
            reader = None if fit_alarms is None else fit_alarms.watch_attention
            logged.append(Logged(fit.stability_stats, on_step=reader))
        # No ``aligned=``: the tracker's rows come from the optimizers' parameters, the same on
        # every rank, and every rank runs the attention and output modules in every training
        # forward, so no collective lines up the ranks' rows.
        return Attached(tracker.registry, logged, on_remove=self._on_hooks_removed)

    def _make_tracker(self, trainer: TrainerView, pl_module: nn.Module) -> GradFlowTracker:
        """Build the fit's tracker for the Trainer's optimizers and gradient clipping."""
        return GradFlowTracker(
            pl_module,
            trainer.optimizers,
            types=self.types,
            include=self.include,
            exclude=self.exclude,
            update_ratio=self.update_ratio,
            output_grad=self.output_grad,
            post_clip=gradient_clipping(trainer) is not None,
            max_layers_logged=self.max_layers_logged,
            guard=self.hook_guard(),
        )

    def _draw_pictures(self, trainer: TrainerView, table: LayerTable) -> None:
        """Draw the chart, heatmap and histograms of an epoch of the running fit."""
        fit = self._fit
        if fit is not None:
            self._pictures.write(trainer, table, fit.gradient_histograms, fit.tracker.shards)

    def _on_hooks_removed(self) -> None:
        """End the fit: at its end, or after a failure the ranks agreed on.

        The fit's alarm state is carried to the next fit, with one warning if an alarm stopped it.
        """
        self._fit = None
        self._alarms_across_fits.end()

    @override
    @guarded
    def on_before_optimizer_step(
        self, trainer: TrainerView, pl_module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        """Measure the gradient ``optimizer`` is about to apply, then pass it to the alarms.

        The gradients are unscaled by the trainer's GradScaler scale, if it has one.
        """
        fit = self._fit
        if fit is None:  # not attached, or disabled
            return
        step = trainer.global_step
        if fit.observed is optimizer and fit.observed_step == step:
            return  # LBFGS: each evaluation of its closure in one step runs this hook again
        fit.observed = optimizer
        fit.observed_step = step
        scale, param_grad_scale = loss_scales(trainer, optimizer)
        measured = fit.tracker.observe(
            optimizer, grad_scale=scale, param_grad_scale=param_grad_scale
        )
        if fit.gradient_histograms is not None:
            layout = fit.tracker.layout
            observe_histograms(fit.gradient_histograms, layout, optimizer, param_grad_scale)
        fit.alarms.check_gradients(
            optimizer, measured, grad_scale=scale, param_grad_scale=param_grad_scale
        )

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
        """Pass the batch's loss to the loss rules; if the batch ended a logging step, write it.

        The loss rules read every batch. A logging step's alarm counts and text are written at
        the same step as its values.
        """
        fit = self._fit
        if fit is None:  # not attached, or disabled
            self.lifecycle.end_batch(trainer)
            return
        if fit.stability_stats is not None and self.lifecycle.measuring:
            fit.stability_stats.end_step()  # the measured batch's attention statistics are whole
        # The loss before the lifecycle: under several processes its all_reduce also carries the
        # ranks' failures and stop requests. Where they are read at once (off CUDA), the ranks
        # have agreed on this batch, and the lifecycle's end of the batch needs no collective of
        # its own.
        fit.alarms.feed_loss(outputs, self.lifecycle.batch_step)
        logged_step = self.lifecycle.end_batch(trainer)  # a failure here removes the fit
        if logged_step is not None:
            fit.alarms.log_step(logged_step)

    @override
    @guarded
    def on_train_epoch_end(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Log the epoch's aggregates and pictures, then close the epoch for the alarms."""
        still_attached = self.lifecycle.end_epoch(trainer)  # not after a failure ranks agreed on
        fit = self._fit
        if still_attached and fit is not None:
            fit.alarms.end_epoch()
            save_loggers(trainer.loggers)  # what the alarms wrote of the epoch


def _refusal_under_fabric(actions: Mapping[str, Action], rules: AlarmRules | None) -> str | None:
    """Return why ``"stop"`` cannot run in a Fabric loop (no ``should_stop``), or ``None``."""
    stopping = sorted(rule for rule, action in actions.items() if action == "stop")
    if rules is None or not stopping:
        return None
    return (
        f"on_alarm='stop' (for {stopping}) needs a Trainer: a Fabric loop has no should_stop to "
        "set. Under Fabric on_alarm must be in ('warn', 'raise', 'skip', 'log'), got 'stop'."
    )


class _NoAlarms:
    """The fit's alarms under ``alarms=False``: each call does nothing.

    It stands in for a :class:`FitAlarms` as Lightning's ``PassThroughProfiler`` stands in for a
    profiler, so the fit calls its alarms the same way whether they run or not.
    """

    def check_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        measured: Measured | None,
        *,
        grad_scale: torch.Tensor | None,
        param_grad_scale: torch.Tensor | None,
    ) -> None:
        """Do nothing: no rule reads the gradients."""

    def feed_loss(self, outputs: STEP_OUTPUT, step: int) -> None:
        """Do nothing: no rule reads the loss."""

    def log_step(self, step: int) -> None:
        """Do nothing: there are no alarm counts to log."""

    def end_epoch(self) -> None:
        """Do nothing: there are no alarms to act on or log."""


@dataclass
class _Fit:
    """What measures one fit of :class:`GradFlowCallback`, and the fit's alarms.

    It is made at the fit's train start and dropped when the fit ends. The callback's Lightning
    hooks call each part by name.
    """

    tracker: GradFlowTracker
    """Measures the gradient flow of the fit's layers."""
    alarms: FitAlarms | _NoAlarms
    """The fit's alarms, which the callback's ``AlarmsAcrossFits`` starts, holds as ``running``
    and ends; under ``alarms=False``, a stand-in that does nothing."""
    stability_stats: StabilityStats | None
    """The instability statistics, under ``stability=True``."""
    gradient_histograms: LayerHistograms | None
    """The histograms of ``log10 |g|``, under ``histograms=True``."""
    observed: torch.optim.Optimizer | None = None
    """The optimizer whose gradients were measured last, at :attr:`observed_step`: an
    optimizer step is measured once, at its first ``on_before_optimizer_step``."""
    observed_step: int = -1


_TRACKER_STATE = ("layers", "units", "total", "peak", "count", "stats")
"""The keys of the tracker's state that release 0.2.0 saved at the top of the callback's state."""


def _upgrade_0_2_0_state(state: dict[str, Any]) -> dict[str, Any]:
    """Convert a state saved by release 0.2.0 to this release's layout; return others unchanged.

    Release 0.2.0 saved the tracker's state at the top level, and the state of the instability
    statistics under ``"stability"``. This release saves each one under a key made of its
    position and class name.
    """
    if not all(key in state for key in _TRACKER_STATE):  # not the 0.2.0 layout
        return dict(state)
    rest = {k: v for k, v in state.items() if k not in (*_TRACKER_STATE, "stability")}
    converted = {f"0:{GradFlowTracker.__name__}": {k: state[k] for k in _TRACKER_STATE}}
    if "stability" in state:
        converted[f"1:{StabilityStats.__name__}"] = state["stability"]
    return {**converted, **rest}


def _histograms(tracker: GradFlowTracker) -> LayerHistograms:
    """Make empty histograms of ``log10 |g|``, one per layer, on the layers' device."""
    layout = tracker.layout
    return LayerHistograms(len(layout.layers), device=layout.index.device)


def _alarm_rules(alarms: AlarmRules | bool, owner: str) -> AlarmRules | None:
    """Return the alarm rules that ``alarms`` asks for.

    ``True`` asks for the default rules, ``False`` for none (``None``), and an ``AlarmRules``
    for itself.

    Raises:
        TypeError: if ``alarms`` is neither an ``AlarmRules`` nor a bool.
    """
    if not isinstance(alarms, AlarmRules | bool):
        raise TypeError(
            f"{owner}(alarms={alarms!r}): expected an AlarmRules or a bool, "
            f"got {type(alarms).__name__}"
        )
    if alarms is True:
        return AlarmRules()
    if alarms is False:
        return None
    return alarms
