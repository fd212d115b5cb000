"""``SelectedStat``: a :class:`~.stat.LayerStat` of the modules its ``types`` / ``include`` /
``exclude`` arguments select, the constructor set-up every hooked tracker shares."""

from __future__ import annotations

from typing import TypeVar

from typing_extensions import TypedDict

from lightning_hooks.core.hooks.selection import ModuleTypes, Patterns, Selection
from lightning_hooks.core.stats.stat import LayerStat

__all__ = ["SelectedStat", "SelectionArgs"]

R = TypeVar("R")


class SelectionArgs(TypedDict, total=False):
    """The keyword arguments that select a tracker's modules (see :meth:`Selection.of`)."""

    types: ModuleTypes
    include: Patterns
    exclude: Patterns


class SelectedStat(LayerStat[R]):
    """Base of the trackers that hook the modules ``selection`` picks; errors name ``owner``.

    A subclass takes ``**selection: Unpack[SelectionArgs]`` beside its own arguments, calls
    ``super().__init__(owner, selection)``, declares its states, then attaches to the model
    it was given (if any).

    Args:
        owner: the public name errors give (a callback passes its own).
        selection: the ``types`` / ``include`` / ``exclude`` arguments it was given.
        default_types: ``types`` when ``selection`` has none.

    Raises:
        TypeError: ``selection`` holds another argument (a typo).
    """

    def __init__(
        self, owner: str, selection: SelectionArgs, default_types: ModuleTypes = None
    ) -> None:
        unknown = sorted(set(selection) - set(SelectionArgs.__annotations__))
        if unknown:
            name = type(self).__name__
            raise TypeError(f"{name}.__init__() got an unexpected keyword argument {unknown[0]!r}")
        super().__init__(
            Selection.of(
                owner,
                types=selection.get("types", default_types),
                include=selection.get("include"),
                exclude=selection.get("exclude"),
            )
        )
        self.owner = owner
