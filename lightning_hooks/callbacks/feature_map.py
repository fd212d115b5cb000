"""The ``FeatureMapCallback``, which draws the layers' responses to a fixed probe batch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.exceptions import MisconfigurationException
from lightning_utilities.core.apply_func import apply_to_collection
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import nn
from typing_extensions import override

from lightning_hooks.callbacks.attached import Attached, epoch_step
from lightning_hooks.callbacks.base import HookCallback
from lightning_hooks.callbacks.fabric_run import UNDER_FABRIC
from lightning_hooks.callbacks.trainer import TrainerView, lightning_module_of
from lightning_hooks.callbacks.watching import nothing_to_watch
from lightning_hooks.core import capture_outputs, checks, probe_mode, select_modules
from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.hooks.guard import guarded
from lightning_hooks.core.hooks.selection import Patterns, as_patterns
from lightning_hooks.errors import LightningHooksError
from lightning_hooks.logging import (
    feature_map_grid,
    log_embedding,
    log_image,
    log_scalars,
    save_loggers,
)
from lightning_hooks.tags import FEATURE_MAP, family_tag, layer_tag

__all__ = ["FeatureMapCallback", "ProbeInputError"]

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _named(
    model: nn.Module, argument: str, patterns: Patterns, owner: str
) -> list[tuple[str, nn.Module]]:
    """Find the modules that ``patterns`` name.

    Args:
        model: the model whose qualified module names the patterns are matched against.
        argument: the constructor argument the patterns came from (the error names it first).
        patterns: glob patterns on qualified module names.
        owner: the callback whose argument it is, which the error names.

    Returns:
        ``(name, module)`` of each module named, in the model's order.

    Raises:
        ValueError: a pattern names no module.
    """
    try:
        return select_modules(model, include=patterns)
    except ValueError as err:
        raise ValueError(f"{owner}({argument}={patterns!r}): {err}") from None


@named_arguments
class FeatureMapCallback(HookCallback):
    r"""Draws the feature maps of a fixed probe batch each epoch, and optionally its embedding.

    Logged metrics, at the epoch's step (:func:`~.attached.epoch_step`):

    ==================================  ======================================================
    Tag                                 Value
    ==================================  ======================================================
    ``feature_map/{layer}`` (image)     the layer's output on the probe, grayscale grid
    ``feature_map/abs_mean/{layer}``    mean ``|output|`` of the layer on the probe batch
    projector: ``feature_map/{layer}``  with ``embedding=layer``: the probe's flattened
                                        outputs at that layer, labelled when labels exist
    ==================================  ======================================================

    Args:
        layers: layer names or glob patterns to draw (default: every convolution, else ``Linear``).
        max_layers: the most layers drawn, spread from input to output.
        channels: the most channels drawn per conv layer.
        probe: a model input (default: the first ``probe_size`` samples of the first batch).
        probe_labels: one label per probe sample, for the projector.
        probe_size: how many samples of the first training batch form the probe.
        input_fn: ``batch -> model input``, for batches that are not ``(input, ...)``; without
            a usable input the fit stops at its first batch with a ``TypeError``.
        forward_fn: ``(pl_module, probe) -> output``, for a LightningModule without ``forward``
            (default: ``pl_module(probe)``).
        embedding: a layer whose flattened probe outputs go to TensorBoard's projector.
        every_n_epochs: run the probe (rank 0, eval mode, ``no_grad``) at every n-th epoch's end.
        strict: ``True``: a hook's exception propagates; ``False``: it disables the callback
            with one warning; ``None``: ``LIGHTNING_HOOKS_STRICT``.

    Example:
        >>> callback = FeatureMapCallback(layers="features.*", embedding="head", probe_size=32)
        >>> callback.probe_size
        32
    """

    def __init__(  # noqa: PLR0913 (a callback's public constructor: one keyword per option)
        self,
        *,
        layers: Patterns = None,
        max_layers: int = 8,
        channels: int = 16,
        probe: Any = None,  # noqa: ANN401 (the probe is the model's input, whatever it is; LightningCLI reads the type)
        probe_labels: torch.Tensor | None = None,
        probe_size: int = 64,
        input_fn: Callable[[Any], Any] | None = None,
        forward_fn: Callable[[pl.LightningModule, Any], Any] | None = None,
        embedding: str | None = None,
        every_n_epochs: int = 1,
        strict: bool | None = None,
    ) -> None:
        owner = type(self).__name__  # a subclass's own name, as the lifecycle's messages give
        self.max_layers = checks.positive_int(owner, "max_layers", max_layers)
        self.channels = checks.positive_int(owner, "channels", channels)
        self.probe_size = checks.positive_int(owner, "probe_size", probe_size)
        self.every_n_epochs = checks.positive_int(owner, "every_n_epochs", every_n_epochs)
        self.layers = as_patterns(layers, f"{owner}(layers={layers!r})")
        self.input_fn = checks.callable_or_none(owner, "input_fn", input_fn) or default_input
        self.forward_fn = checks.callable_or_none(owner, "forward_fn", forward_fn)
        if embedding is not None and not isinstance(embedding, str):
            raise TypeError(
                f"{owner}(embedding={embedding!r}): must be a module name (str) or None, "
                f"got {embedding!r}"
            )
        self.embedding = embedding
        super().__init__(
            state_key={"layers": self.layers, "embedding": self.embedding},
            uses_images=True,
            fabric_refusal="it draws its probe images from the training batch, which Fabric "
            f"does not hand to callbacks. {UNDER_FABRIC}",
        )
        self.strict = None if strict is None else checks.boolean(owner, "strict", strict)
        if probe_labels is not None and not isinstance(probe_labels, torch.Tensor):
            raise TypeError(
                f"{owner}(probe_labels={probe_labels!r}): must be a tensor of one label per "
                f"probe sample or None, got {type(probe_labels).__name__}"
            )
        # The user's probe serves every fit; one taken from a batch belongs to its fit alone.
        self._given_probe = probe
        self._given_labels = probe_labels
        self._fit: _FitProbe | None = None

    @override
    def on_fit_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Check that the model can run the probe, and that it has layers to draw."""
        if self.lifecycle.watching:
            self.lifecycle.watching = self._can_draw(pl_module)

    def _can_draw(self, pl_module: nn.Module) -> bool:
        """Check the model runs a probe and names the embedding, and that it has layers to draw.

        Returns:
            Whether there is anything to draw.

        Raises:
            MisconfigurationException: the model defines no ``forward`` and no ``forward_fn``
                was given.
            ValueError: a name in ``layers`` or ``embedding`` is not a module of the model.
        """
        # LightningModule's own forward only calls nn.Module's stub.
        stubs = (pl.LightningModule.forward, nn.Module.forward)
        if self.forward_fn is None and type(pl_module).forward in stubs:
            raise MisconfigurationException(
                f"{self.lifecycle.owner}: {type(pl_module).__name__} defines no forward(), so the "
                "probe batch cannot run through it. Define forward(), or pass "
                f"{self.lifecycle.owner}(forward_fn=lambda module, probe: ...) that runs the probe."
            )
        drawn = self._layers_drawn(pl_module)
        if self.embedding is not None:
            _named(pl_module, "embedding", self.embedding, self.lifecycle.owner)
        elif not drawn:
            selected = {"layers": self.layers}
            return nothing_to_watch(
                self.lifecycle.owner, "convolution or Linear layer", selected=selected
            )
        return True

    def _layers_drawn(self, pl_module: nn.Module) -> list[str]:
        """Return the layers to draw: those ``layers`` names, or the convolutions, else ``Linear``.

        At most ``max_layers`` of them, spread evenly from the first to the last.

        Raises:
            ValueError: a name in ``layers`` is not a module of the model.
        """
        if self.layers:
            names = [
                name for name, _ in _named(pl_module, "layers", self.layers, self.lifecycle.owner)
            ]
        else:
            names = [name for name, _ in select_modules(pl_module, types=_CONV)]
            names = names or [name for name, _ in select_modules(pl_module, types=nn.Linear)]
        if len(names) > self.max_layers:  # evenly spaced from first to last
            picks = np.linspace(0, len(names) - 1, self.max_layers).round().astype(int)
            names = [names[i] for i in np.unique(picks)]
        return names

    @override
    @guarded
    def on_train_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Start the fit's probe and layers; no hook: the maps are drawn at epoch ends.

        The fit's probe, and one taken from a batch with it, go when the fit ends.
        """
        if self.lifecycle.start_training():
            drawn = self._layers_drawn(pl_module)
            self._fit = _FitProbe(drawn, self._given_probe, self._given_labels)
            self.lifecycle.attach(Attached(None, on_remove=self._on_hooks_removed))

    def _on_hooks_removed(self) -> None:
        """Drop the fit's probe and layers when the fit ends."""
        self._fit = None

    @override
    @guarded
    def on_train_batch_start(
        self, trainer: TrainerView, pl_module: nn.Module, batch: Any, batch_idx: int
    ) -> None:
        """Take the probe from the fit's first logging batch, unless the user gave one."""
        if self.lifecycle.start_batch(trainer, batch_idx):
            self._take_probe(batch)

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
        """End the batch for the cadence."""
        self.lifecycle.end_batch(trainer)

    @override
    @guarded
    def on_train_epoch_end(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Draw the probe's feature maps, every ``every_n_epochs`` epochs."""
        if self.lifecycle.end_epoch(trainer):
            self._draw(trainer, pl_module)
            save_loggers(trainer.loggers)

    def _take_probe(self, batch: Any) -> None:  # noqa: ANN401 (the user's batch)
        """Take the probe from ``batch``, unless the fit has one.

        Args:
            batch: the training batch whose first ``probe_size`` samples (and labels, where it has
                them) become the probe.

        Raises:
            ProbeInputError: ``input_fn`` finds no model input in ``batch``.
        """
        fit = self._fit
        if fit is not None and fit.inputs is None:
            size = self.probe_size  # the first samples, copied
            fit.inputs = apply_to_collection(
                self._model_input(batch), torch.Tensor, lambda x: x[:size].detach().clone()
            )
            fit.labels = default_labels(batch, self.probe_size)

    def _model_input(self, batch: object) -> object:
        """Take the model input of the first training batch.

        Args:
            batch: the training batch, as the dataloader gave it, handed to ``input_fn``.

        Returns:
            What ``input_fn`` returns of it.

        Raises:
            ProbeInputError: ``input_fn`` raised, or returned no tensor (a ``TypeError`` that
                stops the fit, naming ``input_fn``).
        """
        try:
            x = self.input_fn(batch)
        except ProbeInputError:
            raise
        except Exception as err:
            shown = "None" if self.input_fn is default_input else repr(self.input_fn)
            raise ProbeInputError(
                f"{self.lifecycle.owner}(input_fn={shown}): raised {type(err).__name__}: {err} on "
                f"the first training batch (a {type(batch).__name__}); pass "
                "input_fn=lambda batch: ... that returns the model input, or probe=..."
            ) from err
        if not has_tensor(x):
            raise ProbeInputError(
                f"{self.lifecycle.owner}(input_fn=...): the model input taken from the first "
                f"training batch holds no tensor, got {type(x).__name__}; pass "
                "input_fn=lambda batch: ... that returns the model input, or probe=..."
            )
        return x

    def _draw(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Run the probe through the model and draw the chosen layers' outputs, on rank 0."""
        fit = self._fit
        if fit is None or fit.inputs is None or not trainer.is_global_zero:
            return
        if (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        wanted = [*fit.drawn, *([self.embedding] if self.embedding else [])]
        module = lightning_module_of(self.lifecycle.owner, pl_module)  # Fabric refuses the callback
        probe = apply_to_collection(fit.inputs, torch.Tensor, lambda x: x.to(module.device))
        with probe_mode(module), capture_outputs(module, wanted, clone=True) as outputs:
            (self.forward_fn or type(module).__call__)(module, probe)
        step = epoch_step(trainer)
        drawn = [(n, outputs[n]) for n in fit.drawn if isinstance(outputs.get(n), torch.Tensor)]
        if drawn:  # one copy to the host
            means = torch.stack([out.float().abs().mean() for _, out in drawn]).cpu().tolist()
            tags = [layer_tag(FEATURE_MAP, "abs_mean", name) for name, _ in drawn]
            log_scalars(trainer.loggers, dict(zip(tags, means, strict=True)), step)
        for name, output in drawn:
            if 2 <= output.dim() <= 5:
                image = feature_map_grid(output, self.channels)
                log_image(trainer.loggers, family_tag(FEATURE_MAP, name), image, step)
        if self.embedding is not None and isinstance(outputs.get(self.embedding), torch.Tensor):
            features = outputs[self.embedding].flatten(1).float().cpu()
            labels = None if fit.labels is None else fit.labels.cpu().tolist()
            tag = family_tag(FEATURE_MAP, self.embedding)
            log_embedding(trainer.loggers, tag, features, labels, step)


@dataclass
class _FitProbe:
    """What one fit of :class:`FeatureMapCallback` draws: its layers and its probe batch.

    It is made at the fit's train start and dropped when the fit ends.
    """

    drawn: list[str]
    """The layers whose outputs are drawn."""
    inputs: Any
    """The probe: the user's, or the first samples of the fit's first logging batch once taken
    (``None`` until then)."""
    labels: torch.Tensor | None
    """One label per probe sample, for the projector, where known."""


class ProbeInputError(LightningHooksError, TypeError):
    """Raised when the first training batch holds no usable model input.

    The guard lets it through, so the fit stops at its first batch.
    """


def has_tensor(x: object) -> bool:
    """Return whether ``x`` holds a tensor.

    Args:
        x: a tensor, or a (nested) list, tuple or mapping.

    Returns:
        Whether ``x`` is a tensor or holds one.
    """
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, Mapping):
        return any(has_tensor(item) for item in x.values())
    if isinstance(x, list | tuple):
        return any(has_tensor(item) for item in x)
    return False


def default_input(batch: object) -> object:
    """Take the model input of a batch.

    Args:
        batch: the training batch, as the dataloader gave it.

    Returns:
        The batch itself if a tensor, else its first element.

    Raises:
        ProbeInputError: the batch is neither a tensor nor a non-empty list or tuple.
    """
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, list | tuple) and batch:
        return batch[0]
    raise ProbeInputError(
        f"FeatureMapCallback(input_fn=None): cannot find the model input in a batch of type "
        f"{type(batch).__name__}; pass input_fn=lambda batch: ... or probe=..."
    )


def default_labels(batch: object, size: int) -> torch.Tensor | None:
    """Take the labels of a batch, for the embedding.

    Args:
        batch: the training batch, whose second element may hold the labels.
        size: how many samples the probe keeps.

    Returns:
        The second element of a tuple batch when it holds one label per sample (its first
        ``size``), else ``None``.
    """
    labels = batch[1] if isinstance(batch, list | tuple) and len(batch) > 1 else None
    if isinstance(labels, torch.Tensor) and labels.dim() == 1 and len(labels) >= size:
        return labels[:size].detach().clone()
    return None
