"""``GradFlowCallback``: how gradients flow through every layer, logged at each epoch end."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Literal

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_warn
from typing_extensions import override

from lightning_hooks.callbacks._base import HookCallback, check_every_n_steps
from lightning_hooks.core import (
    GradFlowTracker,
    LayerHistograms,
    LayerStats,
    ParamLayout,
    select_modules,
)
from lightning_hooks.core.alarms import AlarmRules, GradientAlarm, GradientAlarms
from lightning_hooks.core.selection import ModuleTypes, Patterns, as_patterns
from lightning_hooks.errors import GradientAlarmError, GradientAlarmWarning, LightningHooksWarning
from lightning_hooks.logging import (
    grad_flow_figure,
    layer_epoch_heatmap,
    log_figure,
    log_histogram,
    log_scalars,
    log_text,
)

__all__ = ["GradFlowCallback"]

# (tag suffix, statistic, reduction over the epoch's optimizer steps)
_LOGGED: tuple[tuple[str, str, str], ...] = (
    ("grad_norm", "grad_norm", "mean"),
    ("grad_norm_max", "grad_norm", "peak"),
    ("grad_abs_mean", "grad_abs_mean", "mean"),
    ("grad_abs_max", "grad_abs_max", "peak"),
    ("grad_nonfinite", "grad_nonfinite", "total"),
    ("weight_norm", "weight_norm", "mean"),
    ("update_ratio", "update_ratio", "mean"),
    ("update_ratio_max", "update_ratio", "peak"),
    ("output_grad_norm", "output_grad_norm", "mean"),
    ("output_grad_norm_max", "output_grad_norm", "peak"),
    ("grad_norm_postclip", "grad_norm_postclip", "mean"),
)


Action = Literal["warn", "stop", "raise", "skip"]
_ACTIONS: tuple[Action, ...] = ("warn", "stop", "raise", "skip")
_ACTIONABLE = ("spike", "absolute", "vanishing", "nonfinite")  # amp_overflow: the scaler acts
_SUMMARY_LINES = 100


def _check_actions(on_alarm: Action | Mapping[str, Action]) -> dict[str, Action]:
    given = dict.fromkeys(_ACTIONABLE, on_alarm) if isinstance(on_alarm, str) else on_alarm
    if on_alarm == "skip":
        given = {**given, "vanishing": "warn"}  # skipping steps cannot revive a vanished gradient
    actions: dict[str, Action] = dict.fromkeys(_ACTIONABLE, "warn")
    for rule, action in given.items():
        if rule not in _ACTIONABLE:
            raise ValueError(
                f"GradFlowCallback(on_alarm={on_alarm!r}): rules must be in {_ACTIONABLE}, "
                f"got {rule!r}"
            )
        if action not in _ACTIONS or (action == "skip" and rule == "vanishing"):
            allowed = _ACTIONS if rule != "vanishing" else _ACTIONS[:3]
            raise ValueError(
                f"GradFlowCallback(on_alarm={on_alarm!r}): the action for {rule!r} must be in "
                f"{allowed}, got {action!r}"
            )
        actions[rule] = action
    return actions


def _check_types(types: ModuleTypes) -> None:
    items = types if isinstance(types, tuple) else (types,)
    for t in items:
        if t is not None and not (isinstance(t, type) and issubclass(t, torch.nn.Module)):
            raise TypeError(
                f"GradFlowCallback(types={types!r}): expected an nn.Module subclass or a tuple "
                f"of them, got {t!r}"
            )


class GradFlowCallback(HookCallback):
    r"""Per-layer gradient flow: the gradient the optimizer applies, weights, updates.

    A *layer* is a module owning trainable parameters directly (a ``Linear``, a ``Conv2d``, a
    ``BatchNorm``); its parameters are measured together. At every sampled optimizer step (every
    ``every_n_steps``-th, by default the Trainer's ``log_every_n_steps``, and the first of each
    epoch), on the device and without a host sync, it measures the gradient the optimizer
    applies (in ``on_before_optimizer_step``: accumulated over ``accumulate_grad_batches``,
    all-reduced under DDP, unscaled under AMP), the weights, the update the step makes, and the
    gradient with respect to each layer's output (a tensor hook on the output, which works with
    ``ReLU(inplace=True)``). At each epoch end the mean and max over the epoch's sampled steps
    are reduced across ranks, copied to the host once and logged at ``trainer.global_step``.

    Logged metrics (``{layer}`` is the module's qualified name, e.g. ``encoder.0``):

    ==========================================  ================================================
    Tag                                         Value, over the epoch's optimizer steps
    ==========================================  ================================================
    ``grad_flow/grad_norm/{layer}``             L2 norm of the layer's gradient, mean
    ``grad_flow/grad_norm_max/{layer}``         L2 norm of the layer's gradient, max
    ``grad_flow/grad_abs_mean/{layer}``         mean ``|g|`` over the layer's entries, mean
    ``grad_flow/grad_abs_max/{layer}``          max ``|g|`` over the layer's entries, max
    ``grad_flow/grad_nonfinite/{layer}``        steps with a NaN/Inf gradient entry, total
    ``grad_flow/weight_norm/{layer}``           L2 norm of the weights before the step, mean
    ``grad_flow/update_ratio/{layer}``          ``||w_after - w_before|| / ||w_before||``, mean
    ``grad_flow/update_ratio_max/{layer}``      the same, max
    ``grad_flow/output_grad_norm/{layer}``      L2 norm of d loss / d output, mean
    ``grad_flow/output_grad_norm_max/{layer}``  the same, max
    ``grad_flow/global/{stat}``                 the first eight, over all layers together
    ``grad_flow/global/grad_norm_preclip``      global gradient L2 norm before clipping, mean
    ``grad_flow/global/grad_norm_postclip``     the same after clipping, mean
    ``grad_flow/chart`` (image)                 mean and max ``|g|`` per layer, log scale
    ``grad_flow/alarms/{rule}``                 alarms of the epoch per rule (layer-steps)
    ``grad_flow/alarms`` (text)                 one line per alarm: step, rule, layer, values
    ``grad_flow/global/{stat}_p{q}``            beyond ``max_layers_logged`` layers only: the
                                                5th, 50th, 95th percentile over layers
    ``grad_flow/heatmap`` (image)               with ``heatmap=True``: gradient norm per
                                                layer x epoch, log scale
    ``grad_flow/grad_log10_abs/{layer}``        with ``histograms=True``: histogram of
    (histogram)                                 ``log10 |g|`` over the epoch's steps
    ==========================================  ================================================

    Bounded for deep models: with more than ``max_layers_logged`` layers, an epoch logs the
    per-layer tags of that many layers only (the layers with a non-finite gradient first, then
    half with the largest and half with the smallest gradient norm of the epoch, so the set may
    change between epochs) plus the percentiles over all layers. The chart always shows every
    layer, in a figure of bounded size.

    Early warnings (``alarms``, see :class:`~lightning_hooks.core.AlarmRules` for the defaults)
    are evaluated on the device at every sampled step; ``AlarmRules(every_n_steps=1)`` evaluates
    them at every optimizer step (the steps between sampled ones then read one L2 pass over the
    gradients and one over the weights, not the full statistics): a *spike* (a layer's or the global
    gradient norm above ``spike_factor`` x its running median over ``window`` steps), an
    *absolute* ``max_grad_norm`` (off by default), *vanishing* gradients (a layer below
    ``vanish_fraction`` of the median layer's norm for ``vanish_steps`` steps), *nonfinite*
    gradients or weights (naming where the NaN appeared), and *amp_overflow* (a GradScaler step
    skipped for inf gradients: counted, never an explosion, no action). The verdict is copied to
    the host without blocking and read at the same step on the CPU, at the next step on CUDA.
    ``on_alarm`` says what happens, per rule or for all: ``"warn"`` (a
    :class:`~lightning_hooks.errors.GradientAlarmWarning` on rank 0, once per rule and layer per
    epoch, then only counted), ``"stop"`` (warn, and ``trainer.should_stop`` agreed across ranks:
    training ends after the current step), ``"raise"`` (a
    :class:`~lightning_hooks.errors.GradientAlarmError`; hooks are still removed) or ``"skip"``
    (warn, and the step is not applied: every gradient of the optimizer is set to ``None``, so
    torch optimizers leave weights, momentum and Adam moments untouched, but the LR scheduler
    and ``global_step`` still advance; on CUDA ``"skip"`` reads the verdict of the current
    step, one blocking copy per step).

    The output-gradient norm of a step sums squares over its micro-batches and over every call of
    a module called more than once (under activation checkpointing, reentrant or not, each output
    gradient is counted once). A layer none of whose parameters got a gradient in a step (a
    branch not taken) is left out of that step's gradient statistics; frozen parameters are not
    tracked; outputs that are dicts, tuples or ``None`` are searched for float tensors. A step
    that is skipped (AMP overflow) measures gradients but no update. Scalars go to every logger
    of the Trainer; the chart needs a ``TensorBoardLogger``.

    The two ``clip`` tags appear when ``Trainer(gradient_clip_val=...)`` is set: Lightning clips
    after ``on_before_optimizer_step``, so the post-clip norm is read in an optimizer step
    post-hook (the gradient is still there after the update). Under ``16-mixed`` the GradScaler's
    scale is divided out on the device; a fused optimizer (``Adam(fused=True)``), whose
    gradients Lightning leaves scaled, gets its gradient statistics divided by the same scale.
    Under DDP the values equal one process's on the global batch (see
    :class:`~lightning_hooks.core.GradFlowTracker`), at two collectives per epoch.

    Args:
        types: only modules of these types count as layers (default: any module with parameters).
        include: glob patterns on qualified module names (``"encoder.*"``) to keep.
        exclude: glob patterns on qualified module names to drop.
        update_ratio: measure the update-to-weight ratio (keeps one copy of the parameters).
        output_grad: measure the gradient with respect to each layer's output.
        chart: log the gradient-flow chart image each epoch.
        alarms: the alarm rules (``True``: the defaults of :class:`AlarmRules`; ``False``: off).
        on_alarm: the action for every rule, or a mapping ``{rule: action}`` (others warn);
            ``"skip"`` does not apply to ``"vanishing"``, which then warns.
        max_layers_logged: per-layer tags for at most this many layers per epoch (``None``: all).
        histograms: log a histogram of ``log10 |g|`` per layer each epoch (fixed half-decade
            buckets from 1e-12 to 1e4, counted on the device: one more pass over the gradients
            per step).
        heatmap: log an image of the gradient norm per layer (rows) and epoch (columns) each
            epoch (the history is kept on the host: one float per layer and epoch).
        every_n_steps: measure optimizer steps ``0, n, 2n, ...`` only (``trainer.global_step``);
            ``None`` (default): the Trainer's ``log_every_n_steps`` (50 unless set). The logged
            means and maxima are over the sampled steps; 1 measures every step. Off-sample
            steps cost a Python flag check per hooked layer (plus the alarms' norm-only pass
            when ``AlarmRules.every_n_steps`` is set).

    Example:
        >>> import pytorch_lightning as pl
        >>> trainer = pl.Trainer(callbacks=[GradFlowCallback(exclude="*.bn*")])  # doctest: +SKIP
    """

    def __init__(
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
    ) -> None:
        _check_types(types)
        self.every_n_steps = check_every_n_steps("GradFlowCallback", every_n_steps)
        if not isinstance(alarms, AlarmRules | bool):
            raise TypeError(
                f"GradFlowCallback(alarms={alarms!r}): expected an AlarmRules or a bool, "
                f"got {type(alarms).__name__}"
            )
        self.alarms = AlarmRules() if alarms is True else alarms or None
        self.on_alarm = _check_actions(on_alarm)
        if max_layers_logged is not None and (
            isinstance(max_layers_logged, bool)
            or not isinstance(max_layers_logged, int)
            or max_layers_logged < 1
        ):
            raise ValueError(
                "GradFlowCallback(max_layers_logged=...): must be a positive int or None, "
                f"got {max_layers_logged!r}"
            )
        self.max_layers_logged = max_layers_logged
        self.histograms = histograms
        self._hist: LayerHistograms | None = None
        self._history: list[tuple[int, np.ndarray]] = []
        self.types = types
        self.include = as_patterns(include, f"GradFlowCallback(include={include!r})")
        self.exclude = as_patterns(exclude, f"GradFlowCallback(exclude={exclude!r})")
        self.update_ratio = update_ratio
        self.output_grad = output_grad
        self.chart = chart
        self.heatmap = heatmap
        self.uses_images = chart or heatmap
        self._tracker: GradFlowTracker | None = None
        self._alarm_state: dict[str, Any] | None = None
        self._warned: set[tuple[str, str]] = set()

    @override
    def _validate(self, pl_module: pl.LightningModule) -> None:
        select_modules(pl_module, types=self.types, include=self.include, exclude=self.exclude)

    @override
    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._tracker = GradFlowTracker(
            pl_module,
            trainer.optimizers,
            types=self.types,
            include=self.include,
            exclude=self.exclude,
            update_ratio=self.update_ratio,
            output_grad=self.output_grad,
            post_clip=bool(trainer.gradient_clip_val),
            alarms=self.alarms,
        )
        self._history = []
        if self.histograms:
            layout = self._tracker.layout
            self._hist = LayerHistograms(len(layout.layers), device=layout.index.device)
        self._load_alarm_state()

    def _load_alarm_state(self) -> None:
        alarms = self._tracker.alarms if self._tracker is not None else None
        if alarms is not None and self._alarm_state is not None:
            try:
                alarms.load_state_dict(self._alarm_state)
            except ValueError as err:
                rank_zero_warn(
                    f"GradFlowCallback: {err}; running medians start afresh.",
                    category=LightningHooksWarning,
                )

    @override
    def _detach(self) -> None:
        if self._tracker is not None:
            if self._tracker.alarms is not None:
                self._alarm_state = self._tracker.alarms.state_dict()
            self._tracker.remove()
            self._tracker = None
        self._hist = None

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._tracker is None:
            return
        scale = _grad_scale(trainer)
        # Lightning does not unscale for optimizers that unscale inside their step (fused).
        fused = scale is not None and getattr(optimizer, "_step_supports_amp_scaling", False)
        self._tracker.observe(optimizer, scale, scale if fused else None, step=trainer.global_step)
        if self._hist is not None:
            self._observe_histograms(optimizer)
        if self._tracker.alarms is not None:
            now = "skip" in self.on_alarm.values()
            self._act(trainer, optimizer, self._tracker.alarms.poll(wait=now))

    def _observe_histograms(self, optimizer: torch.optim.Optimizer) -> None:
        if self._hist is None or self._tracker is None:
            return
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        layout = self._tracker.layout
        pairs = [
            (p, row)
            for p, row in zip(layout.params, layout.owner, strict=True)
            if p.grad is not None and id(p) in stepped
        ]
        grads = ParamLayout.grads([p for p, _ in pairs])  # sparse: the coalesced values
        self._hist.update(grads, [row for _, row in pairs])

    def _act(
        self,
        trainer: pl.Trainer,
        optimizer: torch.optim.Optimizer | None,
        alarms: list[GradientAlarm],
    ) -> None:
        stop = False
        for alarm in alarms:
            action = self.on_alarm.get(alarm.rule)
            if action is None:
                continue  # amp_overflow: the GradScaler already skipped the step
            if action == "raise":
                raise GradientAlarmError(
                    alarm.message,
                    rule=alarm.rule,
                    layer=alarm.layer,
                    step=alarm.step,
                    value=alarm.value,
                )
            self._warn_once(alarm)
            stop = stop or action == "stop"
            if action == "skip" and optimizer is not None and alarm.step == trainer.global_step:
                _skip_step(optimizer)
        if "stop" in self.on_alarm.values():
            # Ranks see the same all-reduced gradients, so they agree; under FSDP they may not.
            trainer.should_stop |= trainer.strategy.reduce_boolean_decision(stop, all=False)

    def _warn_once(self, alarm: GradientAlarm) -> None:
        key = (alarm.rule, alarm.layer)
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(alarm.message, category=GradientAlarmWarning)

    @override
    def _save_state(self) -> dict[str, Any]:
        state = {} if self._tracker is None else self._tracker.state()
        alarms = self._tracker.alarms if self._tracker is not None else None
        alarm_state = alarms.state_dict() if alarms is not None else self._alarm_state
        if alarm_state is not None:
            state["alarms"] = alarm_state
        return state

    @override
    def _load_state(self, state: dict[str, Any]) -> None:
        state = dict(state)
        alarm_state = state.pop("alarms", None)
        if alarm_state is not None:
            self._alarm_state = alarm_state
            self._load_alarm_state()
        if state and self._tracker is not None:
            self._tracker.load_state(state)

    @override
    def _log_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._tracker is None:
            return
        if self._tracker.alarms is not None:
            self._log_alarms(trainer, self._tracker.alarms)
        stats = self._tracker.result()
        self._tracker.reset()
        if not stats.count.any():
            return
        step = trainer.global_step
        log_scalars(trainer.loggers, dict(_scalars(stats, self.max_layers_logged)), step)
        if self._hist is not None:
            self._log_histograms(trainer, self._hist, stats, step)
        if self.chart and trainer.is_global_zero:
            layers = stats.layers[:-1]
            figure = grad_flow_figure(
                layers,
                stats.column("grad_abs_mean")[:-1],
                stats.column("grad_abs_max", "peak")[:-1],
                title=f"gradient flow, epoch {trainer.current_epoch}",
            )
            log_figure(trainer.loggers, "grad_flow/chart", figure, step)
        if self.heatmap and trainer.is_global_zero:
            self._log_heatmap(trainer, stats, step)

    def _log_heatmap(self, trainer: pl.Trainer, stats: LayerStats, step: int) -> None:
        layers, epoch = stats.layers[:-1], trainer.current_epoch
        self._history.append((epoch, stats.column("grad_norm")[:-1].copy()))
        epochs = [e for e, _ in self._history]
        values = np.stack([v for _, v in self._history], axis=1)
        title = "gradient norm per layer and epoch (mean over steps)"
        heatmap = layer_epoch_heatmap(layers, epochs, values, title=title, log=True)
        log_figure(trainer.loggers, "grad_flow/heatmap", heatmap, step)

    def _log_histograms(
        self, trainer: pl.Trainer, hist: LayerHistograms, stats: LayerStats, step: int
    ) -> None:
        # Gradients are all-reduced before the optimizer step: rank 0's counts are every rank's.
        shards = self._tracker.shards if self._tracker is not None else None
        # FSDP2: each rank counted its shard's entries; the whole gradient is their sum.
        counts = (
            hist.host_counts() if shards is None else shards.sum(hist.counts).cpu().double().numpy()
        )
        limits = hist.limits()
        hist.reset()
        if not trainer.is_global_zero:
            return
        for row in _logged_rows(stats, self.max_layers_logged):
            if counts[row].any():
                tag = f"grad_flow/grad_log10_abs/{stats.layers[row]}"
                log_histogram(trainer.loggers, tag, limits, counts[row], step)

    def _log_alarms(self, trainer: pl.Trainer, alarms: GradientAlarms) -> None:
        self._act(trainer, None, alarms.poll(wait=True))
        counts, log = alarms.take_epoch()
        self._warned.clear()
        step = trainer.global_step
        log_scalars(trainer.loggers, {f"grad_flow/alarms/{r}": counts[r] for r in counts}, step)
        if trainer.is_global_zero:
            log_text(trainer.loggers, "grad_flow/alarms", _summary(log, trainer), step)


def _summary(log: list[GradientAlarm], trainer: pl.Trainer) -> str:
    head = f"{len(log)} gradient alarms in epoch {trainer.current_epoch}"
    lines = [f"- step {a.step}, {a.rule}, {a.layer}: {a.message}" for a in log[:_SUMMARY_LINES]]
    if len(log) > _SUMMARY_LINES:
        lines.append(f"- ... and {len(log) - _SUMMARY_LINES} more")
    return "\n".join([head, "", *lines])


def _skip_step(optimizer: torch.optim.Optimizer) -> None:
    """Make the coming ``optimizer.step()`` a no-op: torch optimizers skip ``None`` gradients."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None


_PERCENTILES = (5, 50, 95)


def _scalars(stats: LayerStats, max_layers: int | None = None) -> Iterator[tuple[str, float]]:
    last = len(stats.layers) - 1  # the global row
    rows = _logged_rows(stats, max_layers)
    postclip = stats.count[-1, stats.stats.index("grad_norm_postclip")]
    if postclip > 0:
        yield "grad_flow/global/grad_norm_preclip", float(stats.column("grad_norm")[-1])
    for suffix, stat, kind in _LOGGED:
        column = stats.column(stat, kind)
        counts = stats.count[:, stats.stats.index(stat)]
        for row in (*rows, last):
            if counts[row] == 0:
                continue
            layer = stats.layers[row]
            tag = f"grad_flow/global/{suffix}" if row == last else f"grad_flow/{suffix}/{layer}"
            yield tag, float(column[row])
        if len(rows) < last:
            yield from _percentiles(suffix, column[:last][counts[:last] > 0])


def _logged_rows(stats: LayerStats, max_layers: int | None) -> list[int]:
    """Layer rows to log: all, or non-finite first, then the largest and smallest grad norms."""
    num_layers = len(stats.layers) - 1
    if max_layers is None or num_layers <= max_layers:
        return list(range(num_layers))
    norm = stats.column("grad_norm")[:num_layers]
    nonfinite = stats.column("grad_nonfinite", "total")[:num_layers]
    bad = [int(i) for i in np.flatnonzero((nonfinite > 0) | ~np.isfinite(norm))][:max_layers]
    order = [int(i) for i in np.argsort(np.where(np.isfinite(norm), norm, np.inf)) if i not in bad]
    top = (max_layers - len(bad)) // 2
    smallest = order[: max_layers - len(bad) - top]
    largest = order[len(order) - top :] if top else []
    return sorted({*bad, *smallest, *largest})


def _percentiles(suffix: str, values: np.ndarray) -> Iterator[tuple[str, float]]:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return
    for q, value in zip(_PERCENTILES, np.percentile(values, _PERCENTILES), strict=True):
        yield f"grad_flow/global/{suffix}_p{q:02d}", float(value)


def _grad_scale(trainer: pl.Trainer) -> torch.Tensor | None:
    """The AMP GradScaler's scale as a device tensor (no sync), or ``None`` without AMP."""
    scaler: Any = getattr(trainer.strategy.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None
