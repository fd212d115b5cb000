"""Save a callback's state in checkpoints, and restore it whole or not at all.

The base :class:`~.base.HookCallback` holds one :class:`CheckpointSlot`. Its ``state_dict`` and
``load_state_dict`` hand over to the slot, and its ``on_train_start`` asks the slot to restore
once the fit has attached.
"""

from __future__ import annotations

from typing import Any

from pytorch_lightning.utilities import rank_zero_warn

from lightning_hooks.callbacks.attached import Attached, Checkpointed
from lightning_hooks.errors import LightningHooksWarning

__all__ = ["CheckpointSlot"]


class CheckpointSlot:
    """Hold a callback's checkpoint state, from ``load_state_dict`` until its fit attaches.

    A callback's state has two parts. The statistics of the running fit save their epoch so far
    (:meth:`~.attached.Attached.state_dict`). The collaborators in :attr:`kept` outlive a fit
    and save their own state, each under its key.

    Lightning loads a checkpoint before the fit's hooks exist, so the slot keeps the state
    (:meth:`hold`) until the fit has attached (:meth:`restore`). The restore loads the whole
    state or none of it. If a part does not fit this model, every part already loaded is put
    back as it was, and one warning names what was dropped.

    Args:
        owner: the callback's class name, which starts each warning.

    Example:
        >>> slot = CheckpointSlot("GradFlowCallback")
        >>> slot.save(None)  # no fit attached, and nothing kept
        {}
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.kept: dict[str, Checkpointed] = {}
        """Collaborators that outlive a fit and are saved in checkpoints, by key."""
        self._pending: dict[str, Any] | None = None
        """The state a checkpoint gave, until the next fit attaches. ``None`` if none."""

    def save(self, attached: Attached | None) -> dict[str, Any]:
        """Return what a checkpoint saves: the statistics' state, then that of :attr:`kept`.

        Args:
            attached: what the running fit attached, or ``None`` between fits (then only
                :attr:`kept` is saved).

        Returns:
            Each statistic's epoch so far, reduced across ranks, and the state of each
            collaborator of :attr:`kept` by its key, all on the host.
        """
        state = {} if attached is None else attached.state_dict()
        for key, kept in self.kept.items():
            state[key] = kept.host_state()
        return state

    def hold(self, state: dict[str, Any]) -> None:
        """Keep a checkpoint's ``state`` until the next fit attaches.

        Args:
            state: the callback's state as the checkpoint holds it.
        """
        self._pending = dict(state)

    def restore(self, attached: Attached) -> None:
        """Load the state held, if any, into the fit's statistics and into :attr:`kept`.

        The state is loaded whole or not at all. If a part does not fit this model, nothing of
        it is kept, with one warning. If it holds no entry for some statistic, that statistic
        starts its epoch afresh, with one warning.

        Args:
            attached: what the fit has just attached.
        """
        pending = self._pending
        self._pending = None
        if not pending:
            return
        state = attached.in_this_layout(pending)
        try:
            afresh = self._load_whole(attached, state)
        except (KeyError, ValueError) as err:
            parts = ", ".join(["statistics", *(key for key in self.kept if key in state)])
            rank_zero_warn(
                f"{self.owner}: the checkpoint's state does not match this model ({err}); "
                f"none of it is loaded ({parts})",
                category=LightningHooksWarning,
            )
            return
        if afresh:
            rank_zero_warn(
                f"{self.owner}: the checkpoint holds no state of {', '.join(afresh)} "
                "(saved under another configuration); this epoch's values of it start afresh",
                category=LightningHooksWarning,
            )

    def _load_whole(self, attached: Attached, state: dict[str, Any]) -> list[str]:
        """Load ``state`` into the statistics and into :attr:`kept`, or put each back.

        What :attr:`kept` holds is saved first. If a part fails to load after others did, each
        collaborator then loads what it held before, and the statistics start afresh.

        Args:
            attached: what the fit attached, whose statistics load their part of ``state``.
            state: the callback's state, in this release's layout.

        Returns:
            The statistics that start afresh for want of an entry, by class name.

        Raises:
            KeyError: a part of ``state`` lacks what its statistic or collaborator needs.
            ValueError: a part of ``state`` does not fit this model.
        """
        before = {key: kept.host_state() for key, kept in self.kept.items() if key in state}
        try:
            afresh = attached.load_state_dict(
                {k: v for k, v in state.items() if k not in self.kept}
            )
            for key in before:
                self.kept[key].load_host_state(state[key])
        except (KeyError, ValueError):
            attached.reset_statistics()
            for key, earlier in before.items():
                self.kept[key].load_host_state(earlier)
            raise
        return afresh
