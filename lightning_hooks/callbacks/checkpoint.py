"""Saving a callback's state in checkpoints, and restoring it whole or not at all."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pytorch_lightning.utilities import rank_zero_warn

from lightning_hooks.callbacks.attached import Attached, Checkpointed, Statistic
from lightning_hooks.errors import LightningHooksWarning

__all__ = ["EPOCH", "CheckpointSlot", "rolls_over"]


class CheckpointSlot:
    """A callback's checkpoint state, held from ``load_state_dict`` until its fit attaches.

    A callback's state has two parts: the running fit's statistics save their epoch so far,
    with that epoch's index, and the collaborators in :attr:`kept`, which the callback holds
    across fits, save their own state under their keys. Lightning loads a checkpoint before the
    fit's hooks exist, so the slot holds the state until the fit has attached, then loads all of it
    or none. A statistic's state is saved under its place and class name (``"0:GradFlowTracker"``).

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
        self._upgrade: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self._on_new_epoch: list[Callable[[], None]] = []
        self._failed_fit: dict[str, Any] = {}
        """The statistics' state of a fit that failed, taken before its hooks were removed."""

    def upgrade_old_states_with(self, upgrade: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """Pass each checkpoint's state through ``upgrade``, which reads older releases' layouts.

        Args:
            upgrade: returns a state in this release's layout, and one already in it as it is.
        """
        self._upgrade = upgrade

    def keep(
        self, key: str, kept: Checkpointed, *, on_new_epoch: Callable[[], None] | None = None
    ) -> None:
        """Save ``kept``'s state in checkpoints under ``key``, from now on.

        Args:
            key: the entry of the callback's state that holds it.
            kept: a collaborator the callback holds across fits.
            on_new_epoch: called when a fit resumes from a checkpoint saved at its epoch's last
                batch, before the epoch's end: the fit runs the next epoch, which starts afresh.

        Raises:
            ValueError: ``key`` already holds another collaborator.
        """
        if key in self.kept:
            raise ValueError(f"{self.owner}: the checkpoint already keeps {key!r}")
        self.kept[key] = kept
        if on_new_epoch is not None:
            self._on_new_epoch.append(on_new_epoch)

    def start_new_epoch(self, attached: Attached) -> None:
        """Start the running epoch afresh: the restored state was of an earlier epoch.

        The statistics are reset and each ``on_new_epoch`` given to :meth:`keep` is called.
        The saved epoch's aggregates are not written, as Lightning's own epoch metrics are not.

        Args:
            attached: the running fit's statistics.
        """
        for logged in attached.logged:
            logged.stat.reset()
        for start in self._on_new_epoch:
            start()

    def save(self, attached: Attached | None, epoch: int | None = None) -> dict[str, Any]:
        """Return what a checkpoint saves: the statistics' state, then that of :attr:`kept`.

        Between fits ``attached`` is ``None``, and only :attr:`kept` is saved. The state is on
        the host, reduced across ranks.

        Args:
            attached: what the running fit attached, or ``None`` between fits.
            epoch: the epoch the statistics' state is of (``None``: before the fit's first
                batch).
        """
        state = dict(self._failed_fit) if attached is None else _statistics_part(attached, epoch)
        for key, kept in self.kept.items():
            state[key] = kept.host_state()
        return state

    def keep_failed_fit(self, attached: Attached | None, epoch: int | None) -> None:
        """Keep the statistics' state of a fit that failed, before its hooks are removed.

        Lightning calls its checkpoint callbacks last, so ``OnExceptionCheckpoint`` saves after
        the fit's hooks were removed: it saves this state, which continues the failed epoch.
        The next fit's setup drops it (:meth:`drop_failed_fit`).

        Args:
            attached: what the failed fit attached (``None``: nothing is kept).
            epoch: the epoch its statistics are of.
        """
        self._failed_fit = {} if attached is None else _statistics_part(attached, epoch)

    def drop_failed_fit(self) -> None:
        """Drop the statistics' state kept by :meth:`keep_failed_fit`."""
        self._failed_fit = {}

    def hold(self, state: dict[str, Any]) -> None:
        """Store a checkpoint's ``state`` until the next fit attaches.

        Args:
            state: the callback's state, as ``state_dict`` saved it.
        """
        self._pending = dict(state)

    def drop_held(self) -> None:
        """Drop a state that no fit attached to: the next fit must not continue from it.

        A fit that failed before its train start, one whose callback watched nothing, or a
        ``validate`` run with a checkpoint leave the state they loaded held. The callback drops
        it when the run ends (``teardown``, or ``on_exception``).
        """
        self._pending = None

    def restore(self, attached: Attached) -> int | None:
        """Load the state held, if any, into the fit's statistics and into :attr:`kept`.

        The state is loaded whole or not at all. If a part does not fit this model, or fails to
        load for any other reason (a value of the wrong type), nothing of it is kept, with one
        warning. If it holds no entry for some statistic, that statistic starts its epoch
        afresh, with one warning.

        Args:
            attached: what the fit attached, whose statistics load their part.

        Returns:
            The epoch the loaded statistics are of, or ``None``: nothing loaded, or a state
            saved without it (by release 0.2.0, or between fits).
        """
        pending = self._pending
        self._pending = None
        if not pending:
            return None
        upgrade = self._upgrade
        try:
            state = dict(pending) if upgrade is None else upgrade(pending)
            afresh = self._load_whole(attached, state)
        except Exception as err:  # a state that does not load never ends the fit
            parts = ", ".join(["statistics", *(key for key in self.kept if key in pending)])
            rank_zero_warn(
                f"{self.owner}: the checkpoint's state does not match this model ({err}); "
                f"none of it is loaded ({parts})",
                category=LightningHooksWarning,
            )
            return None
        if afresh:
            rank_zero_warn(
                f"{self.owner}: the checkpoint holds no state of {', '.join(afresh)} "
                "(saved under another configuration); this epoch's values of it start afresh",
                category=LightningHooksWarning,
            )
        epoch = state.get(EPOCH)
        return epoch if isinstance(epoch, int) else None

    def _load_whole(self, attached: Attached, state: dict[str, Any]) -> list[str]:
        """Load ``state`` into the statistics and into :attr:`kept`, or put each back.

        What :attr:`kept` holds is saved first. If a part fails to load after others did, each
        collaborator then loads what it held before, and the statistics start afresh.

        Returns:
            The statistics that start afresh for want of an entry, by class name.

        Raises:
            KeyError: a part of ``state`` lacks what its statistic or collaborator needs.
            ValueError: a part of ``state`` does not fit this model.
            Exception: any other failure to load a part, raised again once each is put back.
        """
        before = {key: kept.host_state() for key, kept in self.kept.items() if key in state}
        try:
            statistics = {k: v for k, v in state.items() if k not in self.kept and k != EPOCH}
            afresh = _load_statistics(attached, statistics)
            for key in before:
                self.kept[key].load_host_state(state[key])
        except Exception:
            for logged in attached.logged:
                logged.stat.reset()  # their epoch so far starts afresh
            for key, earlier in before.items():
                self.kept[key].load_host_state(earlier)
            raise
        return afresh


def rolls_over(saved: int | None, current: int) -> bool:
    """Return whether a state saved in epoch ``saved`` leaves epoch ``current`` to start afresh.

    A checkpoint saved at its epoch's last batch, before the epoch's end, resumes at the next.
    """
    return saved is not None and saved != current


EPOCH = "epoch"
"""The key of the epoch a saved epoch so far is of (the statistics', the alarms' counts)."""


def _state_name(index: int, stat: Statistic[Any]) -> str:
    """Return a statistic's checkpoint name, by place and class: ``"0:GradFlowTracker"``."""
    return f"{index}:{type(stat).__name__}"


def _statistics_part(attached: Attached, epoch: int | None) -> dict[str, Any]:
    """Return the statistics' part of a checkpoint: their state, and the epoch it is of."""
    state = _statistics_state(attached)
    if epoch is not None:
        state[EPOCH] = epoch
    return state


def _statistics_state(attached: Attached) -> dict[str, Any]:
    """Return each statistic's epoch so far by its name, reduced across ranks, on the host."""
    logged = attached.logged
    return {_state_name(i, each.stat): each.stat.host_state() for i, each in enumerate(logged)}


def _load_statistics(attached: Attached, state: dict[str, Any]) -> list[str]:
    """Continue each statistic of ``attached`` from its entry in a checkpoint's ``state``.

    A statistic with no entry (the configuration that saved it did not measure it) starts its
    epoch afresh; the others continue.

    Args:
        attached: the fit whose statistics load.
        state: the statistics' part of the callback's state, in this release's layout. It is
            empty if it was saved outside a fit, and then nothing is loaded.

    Returns:
        The statistics that start afresh for want of an entry, by class name.

    Raises:
        KeyError: the state belongs to another model. Either it holds no entry for any
            statistic, or an entry lacks part of its statistic's state.
        ValueError: the state's values do not fit the statistics.
    """
    if not state:
        return []
    names = [_state_name(i, logged.stat) for i, logged in enumerate(attached.logged)]
    if not any(name in state for name in names):
        raise KeyError(f"the checkpoint holds none of {names}")
    afresh = []
    for name, logged in zip(names, attached.logged, strict=True):
        if name in state:
            logged.stat.load_host_state(state[name])
        else:
            afresh.append(type(logged.stat).__name__)
    return afresh
