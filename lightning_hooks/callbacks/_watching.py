"""What a callback watches: its selection checked against the model before training starts.

:class:`Watching` is mixed into :class:`~lightning_hooks.callbacks._lifecycle.Lifecycle`, which
calls :meth:`Watching._validate` in ``on_fit_start``. A selection that holds nothing is the
user's mistake when they gave it (it raises, naming the arguments they gave) and no one's at the
defaults (one warning, and the callback does nothing in this fit).
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_warn
from torch.nn.parameter import is_lazy

from lightning_hooks.errors import LightningHooksWarning

__all__ = ["Watching"]


class Watching:
    """The selection arguments a callback was given, and what it does when they select nothing."""

    _idle: bool = False
    """Set by :meth:`_nothing_to_watch`: the model has nothing to watch, this fit does nothing."""
    _default_types: Any = None
    """The ``types`` of the default selection (an explicit ``types=`` differs from it)."""
    _selection_arguments: tuple[str, ...] = ("include", "exclude")
    """The constructor arguments, besides ``types``, that narrow the selection."""

    def _validate(self, pl_module: pl.LightningModule) -> None:
        """Check the configuration against the model before training starts."""

    def _explicit_selection(self) -> str:
        """The selection arguments given other values than their defaults, as ``name=value``."""
        types = getattr(self, "types", None)
        given = [f"types={types!r}"] if types is not None and types != self._default_types else []
        for name in self._selection_arguments:
            value = getattr(self, name, None)
            if value:
                given.append(f"{name}={value!r}")
        return ", ".join(given)

    def _nothing_to_watch(self, what: str, hint: str = "") -> None:
        """The selection holds no ``what``: an explicit selection is the user's mistake and
        raises, naming its arguments; at the defaults, one warning and this fit does nothing
        (as Lightning's ``LearningRateMonitor`` without a scheduler).

        Raises:
            ValueError: a selection argument was given.
        """
        name = type(self).__name__
        given = self._explicit_selection()
        if given:
            raise ValueError(f"{name}({given}): selects no {what} of the model{hint}")
        rank_zero_warn(
            f"{name}: the model has no {what} to watch at the defaults; this callback does "
            f"nothing in this fit{hint}",
            category=LightningHooksWarning,
        )
        self._idle = True

    def _lazy_parameters(self, pl_module: pl.LightningModule) -> bool:
        """Whether the model still holds uninitialized lazy parameters (``nn.LazyLinear`` before
        its first forward), whose sizes no statistic of the parameters can be laid out by: one
        warning naming them, and this fit does nothing (training goes on)."""
        lazy = [n for n, p in pl_module.named_parameters() if is_lazy(p)]
        if lazy:
            rank_zero_warn(
                f"{type(self).__name__}: the model's lazy parameters {lazy[:3]} are not "
                "initialized before fit; this callback does nothing in this fit. Initialize "
                "them first: one forward of a sample batch before trainer.fit (or in the "
                "LightningModule's setup)",
                category=LightningHooksWarning,
            )
            self._idle = True
        return bool(lazy)
