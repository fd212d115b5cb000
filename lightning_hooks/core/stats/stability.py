"""Signals of transformer instability: the largest attention logit, the logits' log-partition.

Both grow before a transformer diverges; they are what QK-norm and z-loss address.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from lightning_hooks import internals
from lightning_hooks.core.hooks.registry import HookRegistry
from lightning_hooks.core.hooks.selection import select_modules
from lightning_hooks.core.ops.tensors import is_training_forward, logsumexp_rows
from lightning_hooks.core.stats.activation_stats import owns_parameters
from lightning_hooks.core.stats.attention import (
    AttentionCapture,
    MhaCall,
    attention_head_entropy,
    mha_logit_chunks,
)
from lightning_hooks.core.stats.stat import LayerStat
from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.tags import STABILITY, layer_tag

__all__ = ["STABILITY_STATS", "StabilityStats"]

STABILITY_STATS = ("attn_logit_max", "attn_entropy_min", "logit_logz", "logit_logz_max")
"""The statistics logged as ``stability/{stat}/{layer}``."""


class Result(NamedTuple):
    """What the instability statistics read over a logging step or an epoch, per module.

    Each field maps a module's qualified name to its value; a module the statistic did not see
    (no attention softmax, no floating output) is left out.
    """

    attn_logit_max: dict[str, float]
    """Per attention module: its largest pre-softmax logit."""
    attn_entropy_min: dict[str, float]
    """Per attention module: the smallest mean entropy of one of its heads."""
    logit_logz: dict[str, float]
    """Per output layer: the mean of its rows' ``logsumexp``."""
    logit_logz_max: dict[str, float]
    """Per output layer: the largest of its rows' ``logsumexp``."""


class _LogZ(NamedTuple):
    """What one output measured of its rows' log-partition ``log Z``."""

    total: torch.Tensor  # the sum of log Z over the positions
    positions: int  # the positions it is over
    peak: torch.Tensor  # the largest log Z


def _measure_logz(output: torch.Tensor) -> _LogZ:
    """Return the log-partition of each row of ``output``: summed, counted, peak.

    A row is along the last dimension.
    """
    logz = logsumexp_rows(output.detach())
    return _LogZ(total=logz.sum(), positions=logz.numel(), peak=logz.max())


class StabilityStats(LayerStat[Result]):
    """Measures the attention logits and the output logits' log-partition, signs of instability.

    In the training forwards of logging steps (not inside ``torch.compile``):

    * ``attn_logit_max/{layer}``: the largest pre-softmax logit of an attention layer;
    * ``attn_entropy_min/{layer}``: its smallest head's mean attention entropy (nats);
    * ``logit_logz/{layer}``, ``logit_logz_max/{layer}``: mean and max ``logsumexp`` of the
      output layer's output (the last parameter owner with a floating output; a head applied
      with ``F.linear`` is not seen); not logged for an output layer with one output (a
      regressor's), whose ``logsumexp`` is the output itself.

    ``nn.MultiheadAttention`` logits are recomputed from its inputs, others captured
    (:class:`~.attention.AttentionCapture`).

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> with StabilityStats().attach(model) as stat:
        ...     logits = model(torch.randn(5, 4))
        ...     stat.end_step()
        ...     tags = stat.tags(stat.result())
        >>> sorted(tags)
        ['stability/logit_logz/2', 'stability/logit_logz_max/2']
        >>> abs(tags["stability/logit_logz/2"] - torch.logsumexp(logits, -1).mean().item()) < 1e-5
        True
    """

    attn_max: torch.Tensor
    attn_entropy: torch.Tensor
    attn_rows: torch.Tensor
    logz: torch.Tensor
    logz_max: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_layer_state("attn_max", reduce="max")
        self.add_layer_state("attn_entropy", reduce="sum", kind="unit")  # per head: entropies
        self.add_layer_state("attn_rows", reduce="sum", kind="unit")  # ... and rows summed
        self.add_layer_state("logz", reduce="sum", width=(2,))  # sum of log Z, positions
        self.add_layer_state("logz_max", reduce="max")
        self._attention: set[str] = set()
        self._output: str | None = None
        self._last: str | None = None  # while the output layer is not known: the last candidate
        self._candidates: dict[str, list[_LogZ]] = {}  # and what each candidate measured
        self._capture: AttentionCapture | None = None
        self._checked = False  # whether unseen attention was looked for since attach
        self._mixed_heads: set[str] = set()  # modules warned of calls with other heads
        self._logz_hooks: dict[str, Callable[..., None]] = {}  # the candidates' forward hooks

    def _attached(self, model: nn.Module, registry: HookRegistry) -> None:
        """Find the output layer anew; capture the attention of the other modules."""
        self._output = None
        self._last = None
        self._candidates = {}
        self._checked = False
        self._capture = AttentionCapture(self._add_attention, self._attention).attach(registry)

    def select(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Return every ``nn.MultiheadAttention`` and every module owning parameters directly.

        Args:
            model: the model the modules are selected from.

        Returns:
            ``(name, module)`` of each module to hook.
        """
        modules = select_modules(model, where=lambda _, m: owns_parameters(m))
        self._attention = {n for n, m in modules if isinstance(m, nn.MultiheadAttention)}
        self._logz_hooks = {}  # hooked afresh
        return modules

    def hook_module(self, registry: HookRegistry, name: str, module: nn.Module) -> None:
        """Hook one module: a forward hook for an output-layer candidate, a pre-hook for attention.

        The pre-hook of an ``nn.MultiheadAttention`` recomputes its logits from its inputs.

        Args:
            registry: the registry the hooks go on.
            name: the module's qualified name, its row's name.
            module: the module hooked.
        """
        if name not in self._attention:
            hook = self._forward_hook(name)
            self._logz_hooks[name] = hook
            registry.forward_hook(module, hook, gated=True)
            return

        def attention(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if is_training_forward(module) and not internals.is_compiling():
                assert isinstance(module, nn.MultiheadAttention)
                with torch.no_grad():
                    for chunk in mha_logit_chunks(module, MhaCall.of(args, kwargs)):
                        self._add_attention(name, chunk)

        registry.forward_pre_hook(module, attention, gated=True, with_kwargs=True)

    def _add_attention(self, name: str, logits: torch.Tensor) -> None:
        """Add the peak logit and the per-head entropies of ``logits`` to row ``name``."""
        entropy = attention_head_entropy(logits)
        peak = entropy.peak
        total = entropy.total
        count = entropy.rows
        row = self.rows[name] if name in self.rows else self.row(name, units=total.numel())
        self.attn_max[row] = torch.maximum(self.attn_max[row], peak)
        heads = self.units[row]
        other = total.numel()
        if heads == other:
            self.attn_entropy[self.unit_slice(row)].add_(total)
            self.attn_rows[self.unit_slice(row)].add_(count)
        elif name not in self._mixed_heads:  # another call of the module, other heads: once
            self._mixed_heads.add(name)
            warnings.warn(
                f"StabilityStats: {name!r} made attention calls of {heads} and of {other} heads; "
                f"stability/attn_entropy_min/{name} is over its {heads}-head calls only (the "
                "largest logit is over all of them)",
                LightningHooksWarning,
                stacklevel=1,
            )

    def observe(self, name: str, module: nn.Module, output: object) -> None:
        """Add the output layer's ``log Z`` into its row (held for each candidate until known).

        Args:
            name: the module's qualified name.
            module: the module that ran.
            output: what the module returned.
        """
        if internals.is_compiling() or (self._output is not None and name != self._output):
            return
        if not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return
        if output.dim() == 0 or output.numel() == 0:
            return
        # One output (a regressor's): its log Z is the output itself, so it is not measured,
        # but the layer is still the output layer and no earlier one stands in for it.
        measured = _measure_logz(output) if output.shape[-1] > 1 else None
        if self._output is None:  # the last candidate of a forward is the output layer
            self._last = name
            held = self._candidates.setdefault(name, [])
            if measured is not None:
                held.append(measured)
        elif measured is not None:
            self._add(name, measured)

    def _add(self, name: str, measured: _LogZ) -> None:
        """Add one output's ``log Z`` measurement into row ``name``."""
        row = self.rows[name] if name in self.rows else self.row(name)  # keeps a row's units
        self.logz[row, 0] += measured.total
        self.logz[row, 1] += measured.positions  # a Python int: no copy to the device
        self.logz_max[row] = torch.maximum(self.logz_max[row], measured.peak)

    def end_step(self) -> None:
        """Settle a forward: the last candidate seen is the output layer.

        After the first logging step, warn once of attention not seen.
        """
        capture = self._capture
        registry = self.registry
        if self._last is not None:
            name = self._last
            self._last = None
            self._output = name
            for measured in self._candidates.pop(name):
                self._add(name, measured)
            self._candidates.clear()
            self._drop_other_candidates(name)
        if self._checked or capture is None or registry is None or not registry.logging_step:
            return
        self._checked = True
        unseen = capture.unseen(registry.model)
        if unseen:
            warnings.warn(
                f"StabilityStats: {len(unseen)} module(s) look like attention but made no "
                "scaled_dot_product_attention call nor 4-D softmax that could be seen (inside "
                "torch.compile, a fused kernel called directly, or attention computed another "
                f"way); stability/attn_* is not logged for them: {', '.join(unseen[:5])}"
                f"{' ...' if len(unseen) > 5 else ''}",
                LightningHooksWarning,
                stacklevel=2,
            )

    def _drop_other_candidates(self, output: str) -> None:
        """Remove the module hooks of the candidates but the ``output`` layer, once it is known.

        They have nothing to measure, so a logging step does not run one per parameter owner.
        """
        others = [hook for name, hook in self._logz_hooks.items() if name != output]
        self._logz_hooks = {output: self._logz_hooks[output]} if output in self._logz_hooks else {}
        if self.registry is not None:
            self.registry.drop(others)

    def drain(self) -> None:
        """Settle a forward that :meth:`end_step` has not seen."""
        self.end_step()

    def summarize(self, states: dict[str, np.ndarray]) -> Result:
        """Read the reduced states as each module's statistics.

        Args:
            states: the states reduced across ranks, on the host.

        Returns:
            The statistics per module, each where the module was seen.
        """
        out = Result({}, {}, {}, {})
        logz = states["logz"][:, 0]
        count = states["logz"][:, 1]
        for i, layer in enumerate(self.layers):
            if states["attn_max"][i] != -np.inf:
                out.attn_logit_max[layer] = float(states["attn_max"][i])
            heads = self.unit_slice(i)
            total = states["attn_entropy"][heads]
            rows = states["attn_rows"][heads]
            if (rows > 0).any():
                out.attn_entropy_min[layer] = float((total[rows > 0] / rows[rows > 0]).min())
            if count[i] > 0:
                out.logit_logz[layer] = float(logz[i] / count[i])
                out.logit_logz_max[layer] = float(states["logz_max"][i])
        return out

    def tags(self, result: Result) -> dict[str, float]:
        """Return ``stability/{stat}/{layer}``.

        Args:
            result: what :meth:`summarize` returned.

        Returns:
            The scalars, by tag.
        """
        return {
            layer_tag(STABILITY, stat, layer): value
            for stat, values in result._asdict().items()
            for layer, value in values.items()
        }
