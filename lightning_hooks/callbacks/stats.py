"""``StatsCallback``: any :class:`~.stat.LayerStat`, logged at each logging step and epoch end, and
carried in checkpoints.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_warn
from typing_extensions import override

from lightning_hooks.callbacks.attached import Attached, Logged
from lightning_hooks.callbacks.base import HookCallback
from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.hooks.registry import HookRegistry
from lightning_hooks.core.stats.stat import LayerStat
from lightning_hooks.errors import LightningHooksWarning

__all__ = ["Findings", "StatsCallback"]

# The bare class in the signature: jsonargparse (LightningCLI) resolves a ``class_path`` against
# a class, not against the subscripted generic ``LayerStat[Any]``.
_AnyStat = LayerStat


class Findings:
    """A callback's findings per layer in one fit: the first on each layer is warned, the rest
    are counted and summed up in one warning when the fit's hooks come off.

    Args:
        owner: the callback's name, which the summary begins with.
        noun: what a finding is called in the summary (``"dead-unit findings"``).
    """

    def __init__(self, owner: str, noun: str) -> None:
        self.owner = owner
        self.noun = noun
        self._seen: Counter[str] = Counter()

    def first(self, layer: str) -> bool:
        """Count a finding on ``layer``.

        Returns:
            Whether it is the first on that layer in this fit (to be warned).
        """
        self._seen[layer] += 1
        return self._seen[layer] == 1

    def warn_held_back(self) -> None:
        """Warn once of the findings held back after the first per layer, and start afresh."""
        held = {layer: n - 1 for layer, n in self._seen.items() if n > 1}
        self._seen.clear()
        if held:
            per_layer = ", ".join(f"{layer} x{n}" for layer, n in held.items())
            rank_zero_warn(
                f"{self.owner}: {sum(held.values())} more {self.noun} held back after the first "
                f"warning per layer: {per_layer}",
                category=LightningHooksWarning,
            )


@named_arguments
class StatsCallback(HookCallback):
    """Hooks each statistic on the model in the logging steps' training forwards, and carries
    it in checkpoints.

    Logged metrics: each statistic's ``step_values`` at each logging step, its ``tags`` at each
    epoch end.

    Args:
        stats: one statistic or several; each is attached afresh at every fit.
        every_n_steps: measure optimizer steps ``n-1, 2n-1, ...`` and each epoch's first
            (``None``: the Trainer's ``log_every_n_steps``; 1: every step).

    Example:
        >>> from lightning_hooks.core.stats.activation_stats import ActivationStatsTracker
        >>> callback = StatsCallback(ActivationStatsTracker(), every_n_steps=1)
        >>> len(callback.stats)
        1
    """

    def __init__(
        self,
        stats: _AnyStat | Sequence[_AnyStat],  # type: ignore[type-arg]
        *,
        every_n_steps: int | None = None,
    ) -> None:
        items: tuple[object, ...] = ()
        if isinstance(stats, LayerStat):
            items = (stats,)
        elif isinstance(stats, Sequence):  # a string's characters are refused below
            items = tuple(stats)
        if not items or not all(isinstance(s, LayerStat) for s in items):
            raise TypeError(
                f"{type(self).__name__}(stats={stats!r}): must be a LayerStat or a non-empty "
                f"sequence of them, got {stats!r}"
            )
        super().__init__(every_n_steps=every_n_steps)
        self.uses_images = False
        self.stats: tuple[LayerStat[Any], ...] = tuple(s for s in items if isinstance(s, LayerStat))
        """The statistics, attached afresh at each fit."""
        self.findings = Findings(type(self).__name__, "findings")
        """The findings per layer that a subclass warns of, once per layer per fit."""

    @override
    def _state_key_fields(self) -> dict[str, Any]:
        return {"stats": [s.config_key() for s in self.stats]}

    _watches = "module"  # what the statistics watch, as "nothing to watch" names it
    _watch_hint = ""

    @override
    def _validate(self, pl_module: pl.LightningModule) -> None:
        # A pattern matching no module name raises here, naming it.
        selected = [stat.select(pl_module) for stat in self.stats]
        if not any(selected):
            self._nothing_to_watch(self._watches, self._watch_hint)

    @override
    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Attached:
        registry = HookRegistry(pl_module, guard=self.hook_guard())
        for stat in self.stats:
            stat.attach(pl_module, registry)
        return Attached(
            registry, self._logged(), aligned=self.stats, on_remove=self.findings.warn_held_back
        )

    def _logged(self) -> list[Logged[Any]]:
        """The statistics, each with what this callback reads of its results: by default,
        nothing beyond the scalar tags each logs.

        Returns:
            One :class:`~.attached.Logged` per statistic, in the order of :attr:`stats`.
        """
        return [Logged(stat) for stat in self.stats]
