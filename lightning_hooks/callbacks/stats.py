"""``StatsCallback``: any :class:`~.stat.LayerStat`, logged at each logging step and epoch end, and
carried in checkpoints: the one place where a callback's statistics are windowed, logged and saved.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, TypeVar

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_warn
from typing_extensions import override

from lightning_hooks.callbacks.base import HookCallback
from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.hooks.registry import HookRegistry
from lightning_hooks.core.stats.stat import LayerStat
from lightning_hooks.core.transport import gather_objects
from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.logging import log_scalars, step_tags

__all__ = ["Statistic", "StatsCallback"]

# The bare class in the signature: jsonargparse (LightningCLI) resolves a ``class_path`` against
# a class, not against the subscripted generic ``LayerStat[Any]``.
_AnyStat = LayerStat

R = TypeVar("R")


class Windowed(Protocol[R]):
    """A statistic measured at logging steps: each step's values are copied to the host after
    its optimizer step, and read back when the copy is done."""

    def start_copy(self, step: int) -> None:
        """Start the host copy of the values since the last logging step."""

    def take_copy(self, wait: bool) -> tuple[int, R] | None:
        """The copied step and its result once on the host (``wait``: block), else
        ``None``."""

    @property
    def copy_in_flight(self) -> bool:
        """Whether a copy is still on its way to the host."""

    def step_values(self, result: R) -> dict[str, float]:
        """A window's values under their epoch tags (each step tag is made from one)."""


class EpochResult(Protocol[R]):
    """A statistic aggregated over an epoch's logging steps."""

    def result(self) -> R:
        """The epoch's result, reduced across ranks."""

    def reset(self) -> None:
        """Start the next epoch."""

    def tags(self, result: R) -> dict[str, float]:
        """The epoch's values, under their tags."""


class Checkpointed(Protocol):
    """A statistic whose epoch so far is saved in checkpoints."""

    def host_state(self) -> dict[str, Any]:
        """The epoch so far, reduced across ranks, on the host."""

    def load_host_state(self, state: dict[str, Any]) -> None:
        """Continue the epoch :meth:`host_state` saved."""


class Statistic(Windowed[R], EpochResult[R], Checkpointed, Protocol[R]):
    """What a :class:`StatsCallback` logs and saves of each statistic of a fit: a
    :class:`~.stat.LayerStat` is one, and so is a :class:`~lightning_hooks.core.GradFlowTracker`.
    The rows a :class:`~.stat.LayerStat` makes as modules run are aligned across ranks by the
    callback itself (:meth:`StatsCallback._align_rows`)."""


class SharedRegistry:
    """The hooks of a :class:`StatsCallback`'s fit: its statistics' hooks, on one registry whose
    logging-step gate the base sets and whose ``remove()`` takes them all off."""

    def __init__(self, registry: HookRegistry) -> None:
        self.registry = registry

    def remove(self) -> None:
        self.registry.remove()


@named_arguments
class StatsCallback(HookCallback):
    """Hooks each statistic on the model in the logging steps' training forwards, and carries
    it in checkpoints.

    Logged metrics: each statistic's ``step_values`` at each logging step, its ``tags`` at each
    epoch end.

    Args:
        stats: one statistic or several; each is attached afresh at every fit.
        every_n_steps: measure optimizer steps ``n-1, 2n-1, ...`` and each epoch's first
            (``None``: the Trainer's ``log_every_n_steps``; 1: every step).

    Example:
        >>> from lightning_hooks.core.stats.activation_stats import ActivationStatsTracker
        >>> callback = StatsCallback(ActivationStatsTracker(), every_n_steps=1)
        >>> len(callback.stats)
        1
    """

    _findings: tuple[str, str] | None = None  # (owner, findings) warned once per layer per fit
    stats_made_at_fit: ClassVar[bool] = False
    """Whether the callback makes its statistics at each fit (then it is given none)."""
    aligns_rows = True
    """Whether the ranks align the rows their statistics made (a module that runs on some ranks
    only would otherwise hang the reduce): at each logging step where some rank made one, and
    before a checkpoint."""

    def __init__(
        self,
        stats: _AnyStat | Sequence[_AnyStat],  # type: ignore[type-arg]
        *,
        every_n_steps: int | None = None,
    ) -> None:
        sequence = isinstance(stats, Sequence) and not isinstance(stats, str)
        items = (stats,) if isinstance(stats, LayerStat) else tuple(stats) if sequence else ()
        given = bool(items) or (self.stats_made_at_fit and sequence)
        if not given or not all(isinstance(s, LayerStat) for s in items):
            raise TypeError(
                f"{type(self).__name__}(stats={stats!r}): must be a LayerStat or a non-empty "
                f"sequence of them, got {stats!r}"
            )
        super().__init__(every_n_steps=every_n_steps)
        self.uses_images = False
        self.stats: tuple[LayerStat[Any], ...] = items
        """The statistics, attached afresh at each fit (none where they are made at each fit)."""
        self._measured: tuple[Statistic[Any], ...] = ()  # the running fit's statistics
        self._seen: Counter[str] = Counter()  # findings per layer in this fit

    @override
    def _state_key_fields(self) -> dict[str, Any]:
        return {"stats": [s.config_key() for s in self.stats]}

    _watches = "module"  # what the statistics watch, as "nothing to watch" names it
    _watch_hint = ""

    @override
    def _validate(self, pl_module: pl.LightningModule) -> None:
        # A pattern matching no module name raises here, naming it.
        selected = [stat.select(pl_module) for stat in self.stats]
        if not any(selected):
            self._nothing_to_watch(self._watches, self._watch_hint)

    @override
    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        registry = HookRegistry(pl_module, guard=self.hook_guard())
        for stat in self.stats:
            stat.attach(pl_module, registry)
        self._hooks = SharedRegistry(registry)
        self._measured = self.stats

    @override
    def _detach(self) -> None:
        super()._detach()
        self._measured = ()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._seen.clear()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        held = {layer: n - 1 for layer, n in self._seen.items() if n > 1}
        if held and self._findings and trainer.is_global_zero:
            owner, findings = self._findings
            per_layer = ", ".join(f"{layer} x{n}" for layer, n in held.items())
            rank_zero_warn(
                f"{owner}: {sum(held.values())} more {findings} held back after the first "
                f"warning per layer: {per_layer}",
                category=LightningHooksWarning,
            )

    def _first_finding(self, layer: str) -> bool:
        """Count a finding on ``layer``: whether it is the first of this fit (to be warned)."""
        self._seen[layer] += 1
        return self._seen[layer] == 1

    @property
    def attached(self) -> tuple[Statistic[Any], ...]:
        """The statistics of the running fit (empty outside a fit)."""
        return self._measured

    @override
    def _log_step(self, trainer: pl.Trainer, step: int) -> None:
        for stat in self.attached:
            stat.start_copy(step)

    @override
    def _write_steps(self, trainer: pl.Trainer, wait: bool) -> bool:
        wrote = False
        for stat in self.attached:
            got = stat.take_copy(wait)
            if got is not None:
                step, result = got
                log_scalars(trainer.loggers, step_tags(stat.step_values(result)), step)
                self._read_window(stat, step, result)
                wrote = True
        return wrote

    def _read_window(self, stat: Statistic[Any], step: int, result: object) -> None:
        """What a subclass reads of a logging step's window beyond its scalars (written)."""

    @override
    def _steps_in_flight(self) -> bool:
        return any(stat.copy_in_flight for stat in self.attached)

    @override
    def _log_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The collectives first, on every rank: one whose host side fails later has made them all.
        results = [(stat, stat.result()) for stat in self.attached]
        for stat, result in results:
            stat.reset()
            log_scalars(trainer.loggers, stat.tags(result), trainer.global_step)
            self._log_result(trainer, stat, result)

    def _log_result(self, trainer: pl.Trainer, stat: Statistic[Any], result: Any) -> None:  # noqa: ANN401 (each statistic's own result type)
        """Log what is not a scalar tag (pictures, warnings)."""

    @override
    def _agreement_flags(self) -> list[bool]:
        # whether this rank made rows since they were last aligned across the ranks
        return [any(stat.rows_grew for stat in self._aligned())] if self.aligns_rows else []

    @override
    def _agreed(self, trainer: pl.Trainer, step: int, counts: list[int]) -> bool:
        if counts and counts[0]:
            try:
                self._align_rows()
            except ValueError as error:  # a layer's units differ between ranks: on every rank
                if self.hook_guard().strict:
                    raise
                cause = f"aligning rows across ranks: {type(error).__name__}: {error}"
                return self._disable(trainer, step, [cause] * self._ranks)  # every rank's
        return False

    def _align_rows(self) -> None:
        """Every rank's new rows, in one order on every rank (one ``all_gather_object``)."""
        aligned = self._aligned()
        new = gather_objects([stat.new_rows() for stat in aligned])
        for i, stat in enumerate(aligned):
            stat.align_rows([rank[i] for rank in new])

    def _aligned(self) -> tuple[LayerStat[Any], ...]:
        """The statistics whose rows the ranks align: the given ones, while attached."""
        return self.stats if self.attached else ()

    @override
    def state_dict(self) -> dict[str, Any]:
        """The epoch so far of each statistic, reduced across ranks, on the host."""
        if self._ranks > 1 and self.aligns_rows:
            self._align_rows()  # a checkpoint between logging steps: the rows made since
        return {_state_name(i, s): s.host_state() for i, s in enumerate(self.attached)}

    @override
    def _load_state(self, state: dict[str, Any]) -> None:
        if not state:  # saved outside a fit (``trainer.save_checkpoint`` after it): no epoch
            return
        for i, stat in enumerate(self.attached):
            stat.load_host_state(state[_state_name(i, stat)])


def _state_name(index: int, stat: Statistic[Any]) -> str:
    """A statistic's key in its callback's checkpoint state: its place and its class."""
    return f"{index}:{type(stat).__name__}"
