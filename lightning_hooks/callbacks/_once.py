"""One warning per layer per fit, and one summary at the end of fit of the repeats held back."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_warn
from typing_extensions import override

from lightning_hooks.callbacks.stats import StatsCallback
from lightning_hooks.core.checks import fraction_or_none
from lightning_hooks.core.hooks.selection import Patterns
from lightning_hooks.core.stats.stat import LayerStat
from lightning_hooks.errors import LightningHooksWarning

__all__ = ["OncePerLayer", "WarnsOncePerLayer"]


class OncePerLayer:
    """Remembers, within one fit, which layers were warned about and how often they recurred.

    Example:
        >>> once = OncePerLayer("DeadReLUCallback", "dead-unit findings")
        >>> [once.first("net.1") for _ in range(3)] + [once.first("net.3")]
        [True, False, False, True]
        >>> once.summary().startswith("DeadReLUCallback: 2 more dead-unit findings held back")
        True
        >>> once.summary().endswith("after the first warning per layer: net.1 x2")
        True
        >>> once.reset()
        >>> once.summary() is None
        True
    """

    def __init__(self, owner: str, findings: str) -> None:
        self.owner = owner
        self.findings = findings
        self._seen: Counter[str] = Counter()

    def reset(self) -> None:
        """Forget every layer: the next fit warns afresh."""
        self._seen.clear()

    def first(self, layer: str) -> bool:
        """Count one finding on ``layer``; ``True`` when it is the first of this fit."""
        self._seen[layer] += 1
        return self._seen[layer] == 1

    def summary(self) -> str | None:
        """The repeats held back, per layer in the order first warned; ``None`` when none."""
        held = {layer: n - 1 for layer, n in self._seen.items() if n > 1}
        if not held:
            return None
        per_layer = ", ".join(f"{layer} x{n}" for layer, n in held.items())
        return (
            f"{self.owner}: {sum(held.values())} more {self.findings} held back after the "
            f"first warning per layer: {per_layer}"
        )


class WarnsOncePerLayer(StatsCallback):
    """A :class:`StatsCallback` over one tracker of a module selection, whose layer warnings past
    ``warn_at`` go through :attr:`warned` (one per fit); the tracker's validated selection is
    kept as the callback's ``types``, ``include`` and ``exclude`` (its checkpoint key, its
    errors)."""

    _findings = "findings"

    def __init__(
        self,
        make: Callable[..., LayerStat[Any]],
        types: Any,
        include: Patterns,
        exclude: Patterns,
        warn_at: float | None,
        every_n_steps: int | None,
        /,
        **options: Any,
    ) -> None:
        """``make(types=, include=, exclude=, owner=, **options)`` builds the tracker."""
        name = type(self).__name__
        tracker = make(types=types, include=include, exclude=exclude, owner=name, **options)
        self.warn_at = fraction_or_none(name, "warn_at", warn_at)
        super().__init__(tracker, every_n_steps=every_n_steps)
        self.warned = OncePerLayer(name, self._findings)
        assert tracker.selection is not None
        self.types = types
        self.include, self.exclude = tracker.selection.include, tracker.selection.exclude

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.warned.reset()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        summary = self.warned.summary()
        if summary is not None and trainer.is_global_zero:
            rank_zero_warn(summary, category=LightningHooksWarning)
