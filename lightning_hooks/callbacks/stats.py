"""Provide ``StatsCallback``, which logs any :class:`~.stat.LayerStat` and keeps it in checkpoints.

Each statistic is logged at each logging step and at each epoch end. A *logging step* is an
optimizer step on which the callbacks measure and write their values (see docs/glossary.md).

The module also holds helpers that every callback watching a selection of modules shares. They
build the checkpoint key, check that the selection watches something, and attach the statistics.
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

# The signature uses the bare class. jsonargparse (used by LightningCLI) resolves a
# ``class_path`` against a class, not against the subscripted generic ``LayerStat[Any]``.
_AnyStat = LayerStat


class Findings:
    """Count a callback's findings per layer in one fit, and warn of the first on each layer.

    A *finding* is a problem a callback warns of on one layer, such as a large share of dead
    units. Later findings on the same layer are only counted. One warning sums them up when the
    fit's hooks come off.

    Args:
        owner: the callback's name. The summary begins with it.
        noun: what the summary calls the findings, for example ``"dead-unit findings"``.
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
            Whether it is the first finding on that layer in this fit, which should be warned of.
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


def watches_selection(  # noqa: PLR0913 (a callback's selection: one keyword each)
    owner: str,
    model: nn.Module,
    stats: Sequence[LayerStat[Any]],
    *,
    what: str,
    selected: Mapping[str, object],
    hint: str = "",
) -> bool:
    """Check that the statistics select some module of ``model``.

    A callback's ``_validate`` calls this before the fit.

    Args:
        owner: the callback's name. Its messages begin with it.
        model: the model whose modules the statistics select from.
        stats: the callback's statistics. Each one selects its own modules.
        what: the name the messages give to what is watched, for example ``"module"``.
        selected: the constructor arguments that select modules, with the values the user gave.
            An argument left at its default is ``None`` or empty.
        hint: a clause added to the end of the message when nothing is selected.

    Returns:
        Whether any statistic selects a module of ``model``. If none does and the selection is
        at its defaults, this warns once and returns ``False`` (see :func:`nothing_to_watch`).

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
    """Hook each statistic on ``model`` through one shared hook registry.

    The registry's *gate* puts the hooks on the model for each logging step and takes them off
    after it. Every hook runs under the callback's *guard* (see docs/glossary.md).

    Args:
        model: the model the hooks are put on.
        guard: the guard of the callback's hooks. The registry runs every hook under it.
        logged: each statistic, a :class:`~.stat.LayerStat`, with the callbacks that read its
            results.
        on_remove: called once when the hooks come off.

    Returns:
        What the fit attached. Under several processes, the ranks align the statistics' rows,
        because a module may run on some ranks only. A *row* is a statistic's entry for one
        module.

    Raises:
        TypeError: if a statistic in ``logged`` is not a :class:`~.stat.LayerStat`.
    """
    registry = HookRegistry(model, guard=guard)
    stats = [_layer_stat(item) for item in logged]
    for stat in stats:
        stat.attach(model, registry)
    return Attached(registry, logged, aligned=stats, on_remove=on_remove)


def _layer_stat(logged: Logged[Any]) -> LayerStat[Any]:
    """Return the statistic of ``logged`` after checking that it is a layer statistic.

    Args:
        logged: a statistic with the callbacks that read its results.

    Returns:
        The statistic, typed as a :class:`~.stat.LayerStat`.

    Raises:
        TypeError: if the statistic is not a :class:`~.stat.LayerStat`.
    """
    stat = logged.stat
    if not isinstance(stat, LayerStat):
        raise TypeError(f"attach_stats: {type(stat).__name__} is not a LayerStat")
    return stat


@named_arguments
class StatsCallback(HookCallback):
    """Hook each statistic on the model during the training forward of each logging step.

    A *logging step* is an optimizer step on which the callback measures and writes its values
    (see docs/glossary.md). The state of each statistic is also saved in checkpoints.

    Each statistic logs its ``step_values`` at each logging step and its ``tags`` at each epoch
    end.

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

    The key has the same fields that release 0.2.0 saved under. A checkpoint's state is found
    by this key.

    Args:
        types: the module types selected. ``None`` means any type.
        include: the glob patterns on qualified module names that are kept.
        exclude: the glob patterns on qualified module names that are dropped.

    Returns:
        The fields, by name.

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
    """Refuse or idle a fit whose model has nothing to watch.

    If the user chose the selection, this raises a ``ValueError``. If the selection is at its
    defaults, this warns once and the callback does nothing in the fit. Lightning's
    ``LearningRateMonitor`` does the same when there is no scheduler.

    Args:
        owner: the callback's name. The message begins with it.
        what: what the callback watches, for example ``"module owning a parameter"``.
        selected: the constructor arguments that select modules, with the values the user gave.
            An argument left at its default is ``None`` or empty.
        hint: a clause added to the end of the message.

    Returns:
        ``False``, meaning the fit has nothing to watch. ``_validate`` returns this value.

    Raises:
        ValueError: if the user's selection selects nothing. The message names the arguments
            given.
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
