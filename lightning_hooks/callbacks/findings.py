"""A callback's findings per layer: one warning for the first on each layer, one sum of the rest."""

from __future__ import annotations

from collections import Counter

from pytorch_lightning.utilities import rank_zero_warn

from lightning_hooks.errors import LightningHooksWarning

__all__ = ["Findings"]


class Findings:
    """Counts a callback's findings per layer in one fit, and warns of the first on each layer.

    Later findings (see docs/glossary.md) on the same layer are only counted, and one warning
    sums them up when the fit ends.

    Args:
        owner: the callback's name, which begins the summary.
        noun: what the summary calls the findings, for example ``"dead-unit findings"``.
    """

    def __init__(self, owner: str, noun: str) -> None:
        self.owner = owner
        self.noun = noun
        self._seen: Counter[str] = Counter()

    def first(self, layer: str) -> bool:
        """Count a finding on ``layer``, and return whether it is the first there (to warn of).

        Args:
            layer: the layer the finding is on.
        """
        self._seen[layer] += 1
        return self._seen[layer] == 1

    def warn_held_back(self) -> None:
        """Warn once of the findings held back after the first on each layer, then reset."""
        held = {layer: n - 1 for layer, n in self._seen.items() if n > 1}
        self._seen.clear()
        if held:
            per_layer = ", ".join(f"{layer} x{n}" for layer, n in held.items())
            rank_zero_warn(
                f"{self.owner}: {sum(held.values())} more {self.noun} held back after the first "
                f"warning per layer: {per_layer}",
                category=LightningHooksWarning,
            )
