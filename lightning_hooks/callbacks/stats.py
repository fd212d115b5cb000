"""The ``StatsCallback``, which logs any :class:`~.stat.LayerStat` and saves it in checkpoints.

The module also holds what all callbacks that watch a selection of modules share: the
checkpoint key, the check that the selection matches some module, and the attaching of hooks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pytorch_lightning.utilities import rank_zero_warn
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import nn
from typing_extensions import override

from lightning_hooks.callbacks.attached import Attached, Logged
from lightning_hooks.callbacks.base import HookCallback
from lightning_hooks.callbacks.trainer import TrainerView
from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.hooks.guard import Guard, guarded
from lightning_hooks.core.hooks.registry import HookRegistry
from lightning_hooks.core.stats.stat import LayerStat
from lightning_hooks.errors import LightningHooksWarning

__all__ = [
    "Findings",
    "StatsCallback",
    "attach_stats",
    "nothing_to_watch",
    "selection_state_key",
    "watches_selection",
]

# The bare class: jsonargparse (LightningCLI) resolves a ``class_path`` against a class, not
# against the subscripted generic ``LayerStat[Any]``.
_AnyStat = LayerStat


class Findings:
    """Counts a callback's findings per layer in one fit, and warns of the first on each layer.

    Later findings (see docs/glossary.md) on the same layer are only counted, and one warning
    sums them up when the fit's hooks come off.

    Args:
        owner: the callback's name, which begins the summary.
        noun: what the summary calls the findings, for example ``"dead-unit findings"``.
    """

    def __init__(self, owner: str, noun: str) -> None:
        self.owner = owner
        self.noun = noun
        self._seen: Counter[str] = Counter()

    def first(self, layer: str) -> bool:
        """Count a finding on ``layer``, and return whether it is the first there (to warn of)."""
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


def watches_selection(  # noqa: PLR0913 (a callback's selection: one keyword each)
    owner: str,
    model: nn.Module,
    stats: Sequence[LayerStat[Any]],
    *,
    what: str,
    selected: Mapping[str, object],
    hint: str = "",
) -> bool:
    """Check, in a callback's ``on_fit_start``, that the statistics select some module of ``model``.

    Args:
        owner: the callback's name, which begins its messages.
        model: the model whose modules each statistic selects from.
        stats: the callback's statistics.
        what: what the messages call the watched thing, for example ``"module"``.
        selected: as for :func:`nothing_to_watch`.
        hint: a clause added to the end of the message when nothing is selected.

    Returns:
        Whether any statistic selects a module. If none does and the selection is at its
        defaults, this warns once and returns ``False`` (see :func:`nothing_to_watch`).

    Raises:
        ValueError: if a pattern matches no module name, or the user's selection selects
            nothing.
    """
    chosen = [stat.select(model) for stat in stats]
    if any(chosen):
        return True
    return nothing_to_watch(owner, what, selected=selected, hint=hint)


def attach_stats(
    model: nn.Module,
    guard: Guard,
    logged: Sequence[Logged[Any]],
    *,
    on_remove: Callable[[], None] | None = None,
) -> Attached:
    """Hook each statistic on ``model`` through one shared hook registry, under ``guard``.

    Args:
        model: the model the hooks are put on.
        guard: the guard of the callback's hooks (see docs/glossary.md).
        logged: each :class:`~.stat.LayerStat` with the functions that read its results.
        on_remove: called once when the hooks come off.

    Returns:
        What the fit attached. Every statistic's rows are aligned across ranks, because a
        module may run on some ranks only.

    Raises:
        TypeError: if a statistic in ``logged`` is not a :class:`~.stat.LayerStat`.
    """
    registry = HookRegistry(model, guard=guard)
    stats = [_layer_stat(item) for item in logged]
    for stat in stats:
        stat.attach(model, registry)
    return Attached(registry, logged, aligned=stats, on_remove=on_remove)


def _layer_stat(logged: Logged[Any]) -> LayerStat[Any]:
    """Return the statistic of ``logged``, typed as a :class:`~.stat.LayerStat`.

    Raises:
        TypeError: if the statistic is not a :class:`~.stat.LayerStat`.
    """
    stat = logged.stat
    if not isinstance(stat, LayerStat):
        raise TypeError(f"attach_stats: {type(stat).__name__} is not a LayerStat")
    return stat


@named_arguments
class StatsCallback(HookCallback):
    """Hooks each statistic on the model during the training forward of each logging step.

    Each statistic logs its ``step_values`` at each logging step (see docs/glossary.md) and its
    ``tags`` at each epoch end, and its state is saved in checkpoints.

    Args:
        stats: one statistic or a sequence of them. Each is attached afresh at every fit.
        every_n_steps: measure on optimizer steps ``n-1, 2n-1, ...`` and on the first step of
            each epoch. ``None`` uses the Trainer's ``log_every_n_steps``, and 1 measures every
            step.

    Raises:
        TypeError: if ``stats`` is neither a statistic nor a non-empty sequence of them.

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
        elif isinstance(stats, Sequence):  # a string passes here, and the check below refuses it
            items = tuple(stats)
        if not items or not all(isinstance(s, LayerStat) for s in items):
            raise TypeError(
                f"{type(self).__name__}(stats={stats!r}): must be a LayerStat or a non-empty "
                f"sequence of them, got {stats!r}"
            )
        chosen = tuple(s for s in items if isinstance(s, LayerStat))
        super().__init__(
            state_key={"stats": [s.config_key() for s in chosen]}, every_n_steps=every_n_steps
        )
        self.stats: tuple[LayerStat[Any], ...] = chosen

    @override
    def on_fit_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Check that the statistics select some module of the model."""
        if self.lifecycle.watching:
            name = type(self).__name__
            self.lifecycle.watching = watches_selection(
                name, pl_module, self.stats, what="module", selected={}
            )

    @override
    @guarded
    def on_train_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Hook each statistic on the model for this fit."""
        if self.lifecycle.start_training():
            logged = [Logged(stat) for stat in self.stats]
            self.lifecycle.attach(attach_stats(pl_module, self.hook_guard(), logged))

    @override
    @guarded
    def on_train_batch_start(
        self, trainer: TrainerView, pl_module: nn.Module, batch: Any, batch_idx: int
    ) -> None:
        """Open the hooks' gate where the batch belongs to a logging step."""
        self.lifecycle.start_batch(trainer, batch_idx)

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
        """Write a logging step once its optimizer step has run."""
        self.lifecycle.end_batch(trainer)

    @override
    @guarded
    def on_train_epoch_end(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Write each statistic's epoch."""
        self.lifecycle.end_epoch(trainer)


def selection_state_key(types: object, include: object, exclude: object) -> dict[str, Any]:
    """Make the fields of a callback's checkpoint key from its module selection.

    The fields are those release 0.2.0 saved under, so its checkpoints are still found.

    Example:
        >>> selection_state_key(None, (), ("*.bn*",))
        {'types': 'None', 'include': (), 'exclude': ('*.bn*',)}
        >>> from torch import nn
        >>> selection_state_key((nn.Linear,), (), ()) == selection_state_key(nn.Linear, (), ())
        True
    """
    if isinstance(types, list | tuple):  # one selection, however it is written
        types = types[0] if len(types) == 1 else tuple(types)
    return {"types": repr(types), "include": include, "exclude": exclude}


def nothing_to_watch(
    owner: str, what: str, *, selected: Mapping[str, object], hint: str = ""
) -> bool:
    """Reject, or leave idle, a fit whose model has nothing to watch.

    A selection at its defaults warns once, and the callback does nothing in the fit, as
    Lightning's ``LearningRateMonitor`` does when there is no scheduler.

    Args:
        owner: the callback's name, which begins the message.
        what: what the callback watches, for example ``"module owning a parameter"``.
        selected: the constructor arguments that select modules, with the values the user gave.
            An argument left at its default is ``None`` or empty.
        hint: a clause added to the end of the message.

    Returns:
        ``False``, for the callback's ``on_fit_start`` to set as the lifecycle's ``watching``:
        the fit has nothing to watch.

    Raises:
        ValueError: if the user chose a selection that selects nothing. The message names the
            arguments given.
    """
    given = [f"{argument}={value!r}" for argument, value in selected.items() if value]
    if given:
        raise ValueError(f"{owner}({', '.join(given)}): selects no {what} of the model{hint}")
    rank_zero_warn(
        f"{owner}: the model has no {what} to watch at the defaults; this callback does "
        f"nothing in this fit{hint}",
        category=LightningHooksWarning,
    )
    return False
