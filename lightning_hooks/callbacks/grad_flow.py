"""``GradFlowCallback``: how gradients flow through every layer, logged at each epoch end."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytorch_lightning as pl
import torch
from typing_extensions import override

from lightning_hooks.callbacks._base import HookCallback, check_every_n_steps
from lightning_hooks.core import GradFlowTracker, LayerStats, select_modules
from lightning_hooks.core.selection import ModuleTypes, Patterns, as_patterns
from lightning_hooks.logging import grad_flow_figure, log_figure, log_scalars

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
)


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
    ``BatchNorm``); its parameters are measured together. At every optimizer step, on the device
    and without a host sync, it measures the gradient the optimizer applies (in
    ``on_before_optimizer_step``: accumulated over ``accumulate_grad_batches``, all-reduced under
    DDP, unscaled under AMP), the weights, the update the step makes, and the gradient with
    respect to each layer's output (a tensor hook on the output, which works with
    ``ReLU(inplace=True)``). At each epoch end the mean and max over the epoch's optimizer steps
    are reduced across ranks, copied to the host once and logged at ``trainer.global_step``.

    Logged metrics (``{layer}`` is the module's qualified name, e.g. ``encoder.0``):

    ==========================================  ================================================
    Tag                                         Value, over the epoch's optimizer steps
    ==========================================  ================================================
    ``grad_flow/grad_norm/{layer}``             L2 norm of the layer's gradient, mean
    ``grad_flow/grad_norm_max/{layer}``         L2 norm of the layer's gradient, max
    ``grad_flow/grad_abs_mean/{layer}``         mean ``|g|`` over the layer's entries, mean
    ``grad_flow/grad_abs_max/{layer}``          max ``|g|`` over the layer's entries, max
    ``grad_flow/grad_nonfinite/{layer}``        NaN/Inf gradient entries, total
    ``grad_flow/weight_norm/{layer}``           L2 norm of the weights before the step, mean
    ``grad_flow/update_ratio/{layer}``          ``||w_after - w_before|| / ||w_before||``, mean
    ``grad_flow/update_ratio_max/{layer}``      the same, max
    ``grad_flow/output_grad_norm/{layer}``      L2 norm of d loss / d output, mean
    ``grad_flow/output_grad_norm_max/{layer}``  the same, max
    ``grad_flow/global/{stat}``                 the first eight, over all layers together
    ``grad_flow/chart`` (image)                 mean and max ``|g|`` per layer, log scale
    ==========================================  ================================================

    The output-gradient norm of a step sums squares over its micro-batches and over every call of
    a module called more than once. A step that is skipped (AMP overflow) measures gradients but
    no update. Scalars go to every logger of the Trainer; the chart needs a ``TensorBoardLogger``.

    Args:
        types: only modules of these types count as layers (default: any module with parameters).
        include: glob patterns on qualified module names (``"encoder.*"``) to keep.
        exclude: glob patterns on qualified module names to drop.
        update_ratio: measure the update-to-weight ratio (keeps one copy of the parameters).
        output_grad: measure the gradient with respect to each layer's output.
        chart: log the gradient-flow chart image each epoch.
        every_n_steps: measure optimizer steps ``0, n, 2n, ...`` only (``trainer.global_step``);
            the logged means and maxima are then over the sampled steps. Off-sample steps cost a
            Python flag check per hooked layer.

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
        every_n_steps: int = 1,
    ) -> None:
        _check_types(types)
        self.every_n_steps = check_every_n_steps("GradFlowCallback", every_n_steps)
        self.types = types
        self.include = as_patterns(include, "GradFlowCallback(include=...)")
        self.exclude = as_patterns(exclude, "GradFlowCallback(exclude=...)")
        self.update_ratio = update_ratio
        self.output_grad = output_grad
        self.chart = chart
        self.uses_images = chart
        self._tracker: GradFlowTracker | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(
            types=repr(self.types), include=self.include, exclude=self.exclude
        )

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
        )

    @override
    def _detach(self) -> None:
        if self._tracker is not None:
            self._tracker.remove()
            self._tracker = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._tracker is not None:
            self._tracker.sampled = self._is_sampled_step(trainer)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._tracker is not None:
            self._tracker.observe(optimizer, _grad_scale(trainer))

    @override
    def _log_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._tracker is None:
            return
        stats = self._tracker.result()
        self._tracker.reset()
        if not stats.count.any():
            return
        step = trainer.global_step
        log_scalars(trainer.loggers, dict(_scalars(stats)), step)
        if self.chart and trainer.is_global_zero:
            layers = stats.layers[:-1]
            figure = grad_flow_figure(
                layers,
                stats.column("grad_abs_mean")[:-1],
                stats.column("grad_abs_max", "peak")[:-1],
                title=f"gradient flow, epoch {trainer.current_epoch}",
            )
            log_figure(trainer.loggers, "grad_flow/chart", figure, step)


def _scalars(stats: LayerStats) -> Iterator[tuple[str, float]]:
    for suffix, stat, kind in _LOGGED:
        column = stats.column(stat, kind)
        counts = stats.count[:, stats.stats.index(stat)]
        last = len(stats.layers) - 1  # the global row
        for row, (layer, value, count) in enumerate(zip(stats.layers, column, counts, strict=True)):
            if count == 0:
                continue
            tag = f"grad_flow/global/{suffix}" if row == last else f"grad_flow/{suffix}/{layer}"
            yield tag, float(value)


def _grad_scale(trainer: pl.Trainer) -> torch.Tensor | None:
    """The AMP GradScaler's scale as a device tensor (no sync), or ``None`` without AMP."""
    scaler: Any = getattr(trainer.strategy.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None
