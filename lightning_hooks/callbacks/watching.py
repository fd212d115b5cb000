"""How a callback watches a selection of modules.

This is what the callbacks that watch a selection share: the check that the selection finds
some module, the checkpoint key of a selection, and the hooking of statistics on the model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pytorch_lightning.utilities import rank_zero_warn
from torch import nn

from lightning_hooks.callbacks.attached import Attached, Logged
from lightning_hooks.core.hooks.guard import Guard
from lightning_hooks.core.hooks.registry import HookRegistry
from lightning_hooks.core.stats.stat import LayerStat
from lightning_hooks.errors import LightningHooksWarning

__all__ = ["attach_stats", "nothing_to_watch", "selection_state_key", "watches_selection"]


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
        on_remove: called once when the module hooks are removed.

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
