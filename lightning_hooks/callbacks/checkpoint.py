"""Saving a callback's state in checkpoints, and restoring it whole or not at all."""

from __future__ import annotations

from typing import Any

from pytorch_lightning.utilities import rank_zero_warn

from lightning_hooks.callbacks.attached import Attached, Checkpointed
from lightning_hooks.errors import LightningHooksWarning

__all__ = ["CheckpointSlot"]


class CheckpointSlot:
    """A callback's checkpoint state, held from ``load_state_dict`` until its fit attaches.

    A callback's state has two parts: the running fit's statistics save their epoch so far,
    and the collaborators in :attr:`kept`, which the callback holds across fits, save their own
    state under their keys. Lightning loads a checkpoint before the fit's hooks exist, so the
    slot holds the state until the fit has attached, then loads all of it or none.

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
        """Collaborators the callback holds across fits, saved in checkpoints, by key."""
        self._pending: dict[str, Any] | None = None

    def keep(self, key: str, kept: Checkpointed) -> None:
        """Save ``kept``'s state in checkpoints under ``key``, from now on.

        Args:
            key: the entry of the callback's state that holds it.
            kept: a collaborator the callback holds across fits.

        Raises:
            ValueError: ``key`` already holds another collaborator.
        """
        if key in self.kept:
            raise ValueError(f"{self.owner}: the checkpoint already keeps {key!r}")
        self.kept[key] = kept

    def save(self, attached: Attached | None) -> dict[str, Any]:
        """Return what a checkpoint saves: the statistics' state, then that of :attr:`kept`.

        Between fits ``attached`` is ``None``, and only :attr:`kept` is saved. The state is on
        the host, reduced across ranks.
        """
        state = {} if attached is None else attached.state_dict()
        for key, kept in self.kept.items():
            state[key] = kept.host_state()
        return state

    def hold(self, state: dict[str, Any]) -> None:
        """Store a checkpoint's ``state`` until the next fit attaches."""
        self._pending = dict(state)

    def restore(self, attached: Attached) -> None:
        """Load the state held, if any, into the fit's statistics and into :attr:`kept`.

        The state is loaded whole or not at all. If a part does not fit this model, nothing of
        it is kept, with one warning. If it holds no entry for some statistic, that statistic
        starts its epoch afresh, with one warning.
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
