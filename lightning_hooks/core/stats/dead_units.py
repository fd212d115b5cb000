"""Dead units: the units (:func:`unit_dim`) of a layer that never fired on any training sample.

A unit fires where its output is ``> 0``. A functional ``F.relu`` cannot be hooked: watch the
layer that produces its input (``pre_activation``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from lightning_hooks import internals
from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.hooks.selection import ModuleTypes, Patterns, Selection
from lightning_hooks.core.ops.feature_stats import STACKED
from lightning_hooks.core.ops.tensors import Workspace, iter_float_tensors
from lightning_hooks.core.stats.stat import LayerStat
from lightning_hooks.tags import DEAD_RELU, layer_tag

__all__ = ["RELU_FAMILY", "DeadUnitTracker", "DeadUnits", "fired_counts", "unit_dim"]

RELU_FAMILY: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
)
"""Activation module types watched by default."""


def unit_dim(module: nn.Module, ndim: int) -> int:
    """Return the dimension of a module's ``ndim``-d output that indexes its units.

    Args:
        module: the module, whose type decides.
        ndim: the output's number of dimensions.

    Returns:
        1 for convolutions and batch norms, the last for linear layers, else the last up to 3-d
        and 1 from 4-d.
    """
    if isinstance(module, internals.CHANNEL_FIRST_LAYERS) and ndim >= 2:
        return 1
    if isinstance(module, nn.Linear) or ndim <= 3:
        return ndim - 1
    return 1


_WIDTHS = 4  # widths one module may have (a row each) before its unit dimension is refused
_EXACT = 2**24  # float32 holds every integer up to this exactly


@torch.no_grad()
def fired_counts(y: torch.Tensor, dim: int, workspace: Workspace | None = None) -> torch.Tensor:
    """Count how many entries of each unit (along ``dim``) of ``y`` are ``> 0`` (fired).

    Args:
        y: the output.
        dim: the dimension that indexes units.
        workspace: where the fired mask is kept from one call to the next.

    Returns:
        ``[units]`` integers.
    """
    others = [d for d in range(y.ndim) if d != dim]
    # summed as float32 (exact up to 2**24 elements, faster than bytes on CPU), else as int64
    if y.numel() > _EXACT:
        positive = (y > 0).view(torch.uint8)
        return positive.sum(dim=others, dtype=torch.int64) if others else positive.long()
    ws = workspace or Workspace()
    fired = ws.get(y.numel(), torch.float32, y.device).view(y.shape)
    torch.gt(y, 0, out=fired)
    if not others:
        return fired.to(torch.int32)
    if dim < y.ndim - 1:  # the dims after ``dim`` first: one dense, vectorized reduction
        fired = fired.flatten(dim + 1).sum(dim=-1)
        others = [d for d in others if d < dim]
    return (fired.sum(dim=others) if others else fired).to(torch.int32)


@dataclass(frozen=True)
class DeadUnits:
    """The result of an epoch, one entry per watched layer that ran.

    Attributes:
        layers: the layers' qualified names.
        units: number of units of each layer.
        dead: number of units that never fired.
        zero_fraction: fraction of the outputs that did not fire, averaged over calls.
        calls: number of training forwards observed.
        dead_units: the dead units' indices, per layer.
    """

    layers: tuple[str, ...]
    units: np.ndarray
    dead: np.ndarray
    zero_fraction: np.ndarray
    calls: np.ndarray
    dead_units: tuple[np.ndarray, ...]

    @property
    def dead_fraction(self) -> np.ndarray:
        """``dead / units`` per layer."""
        with np.errstate(divide="ignore", invalid="ignore"):
            fraction: np.ndarray = self.dead / self.units
        return fraction


@named_arguments
class DeadUnitTracker(LayerStat[DeadUnits]):
    """Counts, per unit of activation outputs, how often it fired in an epoch's training forwards.

    A unit that never fired is dead. A module called at several widths gets a row per width
    (``name``, then ``name-{units}``).

    Args:
        model: the model to watch now (``None``: call :meth:`attach` later).
        types: activation module types to watch (default :data:`RELU_FAMILY`).
        include: glob patterns on qualified module names to keep (``None``: every name).
        exclude: glob patterns on qualified module names to drop.
        pre_activation: glob patterns of modules (any type) whose output feeds ``F.relu``.
        unit_dim: the output dimension that indexes units (``1``: the channels of a
            ``[N, C, L]`` Conv1d output; ``-1``: the features of a ``[N, H, W, C]`` channels-last
            output). ``None`` guesses from the module and the output (:func:`unit_dim`): the
            last dimension of a 2-d or 3-d output, dimension 1 from 4-d.
        owner: the public name errors give.

    Example:
        >>> layer = nn.Linear(3, 4)
        >>> with torch.no_grad():
        ...     _ = layer.bias.copy_(torch.tensor([-100.0, -100.0, 0.0, 0.0]))
        >>> model = nn.Sequential(layer, nn.ReLU())
        >>> with DeadUnitTracker(model) as tracker:
        ...     _ = model(torch.randn(32, 3))
        ...     result = tracker.result()
        >>> result.layers, result.dead.tolist(), result.units.tolist()
        (('1',), [2], [4])
    """

    fired: torch.Tensor
    calls: torch.Tensor
    counts: torch.Tensor

    def __init__(  # noqa: PLR0913 (a public constructor: one keyword per option)
        self,
        model: nn.Module | None = None,
        *,
        types: ModuleTypes = RELU_FAMILY,
        include: Patterns = None,
        exclude: Patterns = None,
        pre_activation: Patterns = None,
        unit_dim: int | None = None,
        owner: str = "DeadUnitTracker",
    ) -> None:
        if unit_dim is not None and (isinstance(unit_dim, bool) or not isinstance(unit_dim, int)):
            raise TypeError(f"{owner}(unit_dim={unit_dim!r}): must be an int or None")
        super().__init__(Selection.of(owner, types=types, include=include, exclude=exclude))
        self.owner = owner
        self.unit_dim = unit_dim
        self.workspace = Workspace()  # the largest output's fired mask, reused
        self.producers = Selection.of(
            owner, include=pre_activation, arguments=("pre_activation", "exclude")
        )
        self.add_layer_state("fired", reduce="sum")  # per row: sum over calls of fired fraction
        self.add_layer_state("calls", reduce="sum")
        self.add_layer_state("counts", reduce="sum", kind="unit")
        if model is not None:
            self.attach(model)

    def config_key(self) -> str:
        """Return what tells two instances' checkpoint states apart.

        Returns:
            The base's key with the ``pre_activation`` patterns, and ``unit_dim`` where given.
        """
        key = f"{super().config_key()}:{self.producers.include!r}"
        return key if self.unit_dim is None else f"{key}:unit_dim={self.unit_dim}"

    def select(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Return the watched activations and the ``pre_activation`` producers, in model order.

        Args:
            model: the model the modules are selected from.

        Returns:
            ``(name, module)`` of each module to hook.
        """
        assert self.selection is not None
        named = dict(self.selection.modules(model))
        named.update(self.producers.modules(model) if self.producers.include else ())
        return [(n, m) for n, m in model.named_modules() if n in named]

    def observe(self, name: str, module: nn.Module, output: object) -> None:
        """Count the fired entries per unit of ``output``'s first floating tensor (or at drain).

        Args:
            name: the module's qualified name, its row's name.
            module: the module that ran, whose type gives the unit dimension.
            output: what the module returned.
        """
        if type(output) is torch.Tensor:  # most modules': no walk of the output
            y = output if output.is_floating_point() and output.ndim >= 1 else None
        else:
            y = next((t for _, t in iter_float_tensors(output) if t.ndim >= 1), None)
        if y is None or y.numel() == 0:
            return
        if self.unit_dim is None:
            dim = unit_dim(module, y.ndim)
        elif -y.ndim <= self.unit_dim < y.ndim:
            dim = self.unit_dim % y.ndim
        else:
            raise ValueError(
                f"{self.owner}(unit_dim={self.unit_dim}): layer {name!r} returned a "
                f"{y.ndim}-d output {tuple(y.shape)}"
            )
        row = self._width_row(name, y.shape[dim])
        self.tally("calls", row)
        if y.numel() <= STACKED and not internals.is_compiling():
            # the copy the activation statistics of this model take too: compared at drain
            self._defer((y.shape, dim, y.device, y.dtype), row, self._snapshot(y))
            return
        counts = fired_counts(y, dim, self.workspace)
        self.counts[self.unit_slice(row)].add_(counts)
        self.fired[row].add_(counts.sum(), alpha=1.0 / y.numel())

    def _width_row(self, name: str, units: int) -> int:
        """Return the row of ``name`` at this width: ``name`` for the first, ``name-{units}`` after.

        Raises:
            ValueError: the module ran at more than ``_WIDTHS`` widths.
        """
        index = self.rows.get(name)
        if index is None or self.units[index] == units:
            return self.row(name, units)
        widths = [n for n in self.rows if n.startswith(f"{name}-")]
        if f"{name}-{units}" not in self.rows and len(widths) + 1 >= _WIDTHS:
            return self.row(name, units)  # raises, naming the widths
        return self.row(f"{name}-{units}", units)

    def drain(self) -> None:
        """Count the fired entries of the kept outputs, stacked by shape.

        Then move the host call counts in.
        """
        for (shape, dim, device, _), rows, outputs in self._drain_pending():
            fired = torch.gt(outputs, 0)
            units = shape[dim]
            numel = fired[0].numel()
            counts = fired.movedim(dim + 1, -1).reshape(len(rows), -1, units).sum(1)
            spans = [range(s.start, s.stop) for s in map(self.unit_slice, rows)]
            where = self._pending.index(rows, device, spans)
            self.counts.index_add_(0, where, counts.flatten().to(self.counts.dtype))
            fired_sum = counts.sum(1).to(self.fired.dtype)
            index = self._pending.index(rows, device)
            self.fired.index_add_(0, index, fired_sum, alpha=1.0 / numel)
        super().drain()

    def remove(self) -> None:
        """Count the kept outputs, then remove the hooks (also when counting fails)."""
        try:
            self.drain()
        finally:
            super().remove()

    def summarize(self, states: dict[str, np.ndarray]) -> DeadUnits:
        """Turn the reduced host states into the epoch's result.

        Args:
            states: the fired, call and per-unit count states, reduced across ranks.

        Returns:
            The dead units of each layer that ran.
        """
        units = np.array(self.units[: len(self.rows)], dtype=np.int64)
        ends = np.cumsum(units)  # each row's units lie in [end - units, end) of the flat state
        never = states["counts"][: int(ends[-1]) if len(ends) else 0] == 0
        dead_so_far = np.concatenate([[0], np.cumsum(never, dtype=np.int64)])
        dead = dead_so_far[ends] - dead_so_far[ends - units]  # in one pass, not one per row
        calls = states["calls"]
        with np.errstate(divide="ignore", invalid="ignore"):
            zero_fraction = 1.0 - states["fired"] / calls
        return DeadUnits(
            layers=self.layers,
            units=units,
            dead=dead,
            zero_fraction=zero_fraction,
            calls=calls,
            dead_units=tuple(
                np.flatnonzero(row) for row in np.split(never, ends[:-1])[: len(ends)]
            ),
        )

    def step_values(self, result: DeadUnits) -> dict[str, float]:
        """Return ``zero_fraction`` only, at a logging step.

        A unit is dead over an epoch, not a step.

        Args:
            result: the logging step's result.

        Returns:
            The scalars, by tag.
        """
        return {
            layer_tag(DEAD_RELU, "zero_fraction", layer): float(result.zero_fraction[i])
            for i, layer in enumerate(result.layers)
            if result.calls[i] > 0
        }

    def tags(self, result: DeadUnits) -> dict[str, float]:
        """Return ``dead_relu/{dead_fraction,dead_count,zero_fraction}/{layer}``.

        Args:
            result: the epoch's result.

        Returns:
            The scalars, by tag.
        """
        out: dict[str, float] = {}
        fractions = result.dead_fraction
        for i, layer in enumerate(result.layers):
            out[layer_tag(DEAD_RELU, "dead_fraction", layer)] = float(fractions[i])
            out[layer_tag(DEAD_RELU, "dead_count", layer)] = float(result.dead[i])
            out[layer_tag(DEAD_RELU, "zero_fraction", layer)] = float(result.zero_fraction[i])
        return out
