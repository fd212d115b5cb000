"""Provide ``StatsCallback``, which logs any :class:`~.stat.LayerStat` and keeps it in checkpoints.

Each statistic is logged at each logging step and epoch end. The module also holds what every
callback that watches a selection of modules shares: its checkpoint key, the check that the
selection watches something, and the attaching of its statistics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pytorch_lightning.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_hooks.callbacks.attached import Attached, Logged
from lightning_hooks.callbacks.base import HookCallback
from lightning_hooks.callbacks.trainer import TrainerView
from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.hooks.guard import Guard
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

# The bare class in the signature: jsonargparse (LightningCLI) resolves a ``class_path`` against
# a class, not against the subscripted generic ``LayerStat[Any]``.
_AnyStat = LayerStat


class Findings:
    """Count a callback's findings per layer in one fit, warning of the first on each layer.

    The rest are counted and summed up in one warning when the fit's hooks come off.

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

        Args:
            layer: the qualified name of the module the finding is on.

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


def watches_selection(  # noqa: PLR0913 (a callback's selection: one keyword each)
    owner: str,
    model: nn.Module,
    stats: Sequence[LayerStat[Any]],
    *,
    what: str,
    selected: Mapping[str, object],
    hint: str = "",
) -> bool:
    """Check each statistic's selection on ``model``, the check of a callback's ``_validate``.

    Args:
        owner: the callback's name, which its messages begin with.
        model: the model whose modules the statistics select from.
        stats: the callback's statistics, each selecting its modules.
        what: what the statistics watch (``"module"``), as the messages name it.
        selected: the constructor arguments that select modules, with the values the user gave
            (``None`` or empty where left at the default).
        hint: a clause the message ends with where nothing is selected.

    Returns:
        Whether any statistic selects a module of ``model``; where none does at the defaults,
        ``False`` after one warning (see :func:`nothing_to_watch`).

    Raises:
        ValueError: a pattern matches no module name, or the user's selection selects nothing.
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
    """Hook each statistic on ``model``, on one registry whose gate opens at logging steps.

    Args:
        model: the model the statistics' hooks are put on.
        guard: the guard of the callback's hooks, which the registry runs every hook under.
        logged: each statistic (a :class:`~.stat.LayerStat`) with what the callback reads of its
            results.
        on_remove: called once when the hooks come off.

    Returns:
        What the fit attached; the ranks align the statistics' rows (a module that runs on some
        ranks only).

    Raises:
        TypeError: a statistic of ``logged`` is not a :class:`~.stat.LayerStat`.
    """
    registry = HookRegistry(model, guard=guard)
    stats = [_layer_stat(item) for item in logged]
    for stat in stats:
        stat.attach(model, registry)
    return Attached(registry, logged, aligned=stats, on_remove=on_remove)


def _layer_stat(logged: Logged[Any]) -> LayerStat[Any]:
    """Return the statistic of ``logged``, checked to be a layer statistic.

    Args:
        logged: a statistic with what its callback reads of it.

    Returns:
        The statistic, typed as a :class:`~.stat.LayerStat`.

    Raises:
        TypeError: the statistic is not a :class:`~.stat.LayerStat`.
    """
    stat = logged.stat
    if not isinstance(stat, LayerStat):
        raise TypeError(f"attach_stats: {type(stat).__name__} is not a LayerStat")
    return stat


@named_arguments
class StatsCallback(HookCallback):
    """Hook each statistic on the model in the logging steps' training forwards.

    Each statistic is carried in checkpoints too.

    Logged metrics: each statistic's ``step_values`` at each logging step, its ``tags`` at each
    epoch end.

    Args:
        stats: one statistic or several; each is attached afresh at every fit.
        every_n_steps: measure optimizer steps ``n-1, 2n-1, ...`` and each epoch's first
            (``None``: the Trainer's ``log_every_n_steps``; 1: every step).

    Raises:
        TypeError: ``stats`` is not a statistic or a non-empty sequence of them.

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
        chosen = tuple(s for s in items if isinstance(s, LayerStat))
        super().__init__(
            state_key={"stats": [s.config_key() for s in chosen]}, every_n_steps=every_n_steps
        )
        self.stats: tuple[LayerStat[Any], ...] = chosen
        """The statistics, attached afresh at each fit."""

    @override
    def _validate(self, pl_module: nn.Module) -> bool:
        name = type(self).__name__
        return watches_selection(name, pl_module, self.stats, what="module", selected={})

    @override
    def _attach(self, trainer: TrainerView, pl_module: nn.Module) -> Attached:
        logged = [Logged(stat) for stat in self.stats]
        return attach_stats(pl_module, self.hook_guard(), logged)


def selection_state_key(types: object, include: object, exclude: object) -> dict[str, Any]:
    """Make the fields of a callback's checkpoint key from its module selection.

    The key is the one release 0.2.0 saved under: a checkpoint's state is found by it.

    Args:
        types: the module types selected (``None``: any).
        include: the glob patterns on qualified module names that are kept.
        exclude: the glob patterns on qualified module names that are dropped.

    Returns:
        The fields, by name.

    Example:
        >>> selection_state_key(None, (), ("*.bn*",))
        {'types': 'None', 'include': (), 'exclude': ('*.bn*',)}
    """
    return {"types": repr(types), "include": include, "exclude": exclude}


def nothing_to_watch(
    owner: str, what: str, *, selected: Mapping[str, object], hint: str = ""
) -> bool:
    """Refuse or idle a fit whose model has nothing to watch.

    Where the user selected modules, this is a ``ValueError``; at the defaults it is one warning
    and an idle fit (as Lightning's ``LearningRateMonitor`` without a scheduler).

    Args:
        owner: the callback's name, which the message begins with.
        what: what the callback watches (``"module owning a parameter"``).
        selected: the constructor arguments that select modules, with the values the user gave
            (``None`` or empty where left at the default).
        hint: a clause the message ends with.

    Returns:
        ``False``: the fit has nothing to watch (what ``_validate`` returns).

    Raises:
        ValueError: the user's selection selects nothing, naming the arguments given.
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
