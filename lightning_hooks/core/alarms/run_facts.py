"""What the alarms may know of the run beside its gradients and losses.

The learning rate, read only when an alarm is written (never on the quiet step), and the output
layer's units, whose uniform guess scores ``ln C``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["RunFacts"]


@dataclass(frozen=True)
class RunFacts:
    """The learning rate and the number of output units, where the library can know them.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 10))
        >>> facts = RunFacts.of(model, [torch.optim.SGD(model.parameters(), lr=0.5)])
        >>> facts.learning_rate(), facts.classes, round(facts.chance_loss, 4)
        (0.5, 10, 2.3026)
        >>> RunFacts().learning_rate(), math.isnan(RunFacts().chance_loss)
        (nan, True)
    """

    read_learning_rate: Callable[[], object] | None = None
    """Returns the optimizer's learning rate now (its first parameter group's ``lr``: a float,
    or a tensor); called only when an alarm is written."""
    classes: int | None = None
    """The output layer's units (the last ``nn.Linear``'s ``out_features``), when more than one;
    else ``None``."""

    @classmethod
    def of(cls, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> RunFacts:
        """Return the facts of ``model`` trained by ``optimizers``.

        The first optimizer's learning rate, and the out features of the model's last
        ``nn.Linear`` (in module order).

        Args:
            model: the model trained.
            optimizers: its optimizers (the first one's learning rate is read).

        Returns:
            What the alarms may quote of the run.
        """
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        units = linears[-1].out_features if linears else 0
        read = None
        if optimizers and optimizers[0].param_groups:
            group = optimizers[0].param_groups[0]
            read = group.get  # bound to the group: a scheduler's change is read too
        return cls(
            read_learning_rate=None if read is None else lambda: read("lr"),
            classes=units if units > 1 else None,
        )

    def learning_rate(self) -> float:
        """Return the learning rate now.

        Returns:
            The first parameter group's ``lr`` as a float; NaN where it is not known, or not
            a positive number.
        """
        if self.read_learning_rate is None:
            return math.nan
        value = self.read_learning_rate()
        if isinstance(value, torch.Tensor):
            value = value.item()  # a tensor learning rate: read once, when an alarm is written
        if not isinstance(value, int | float) or not value > 0:
            return math.nan
        return float(value)

    @property
    def chance_loss(self) -> float:
        """``ln C``: the cross-entropy of a uniform guess over the ``C`` output units.

        NaN when ``C`` is not known.
        """
        return math.log(self.classes) if self.classes is not None else math.nan
