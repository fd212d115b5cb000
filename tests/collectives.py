"""Counts the ``torch.distributed`` collectives of a fit, all and those called from our package.

Shared by the multi-process test scripts (``ddp_run.py``, ``ddp_stats_run.py``, ``fsdp_run.py``).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
)


class CollectiveCounter(pl.Callback):
    """Counts ``torch.distributed`` collectives: per step and per epoch, all and ours."""

    def __init__(self) -> None:
        self.all: Counter[str] = Counter()
        self.ours: Counter[str] = Counter()
        self.steps: list[int] = []
        self.epochs: list[dict[str, Any]] = []
        self._marks = (0, 0)
        self._originals = {name: getattr(dist, name) for name in COLLECTIVES}
        for name, original in self._originals.items():
            setattr(dist, name, self._wrap(name, original))

    def restore(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _wrap(self, name: str, original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.all[name] += 1
            if _called_from_package():
                self.ours[name] += 1
            return original(*args, **kwargs)

        return counted

    def on_train_batch_start(self, *args: Any) -> None:
        self._step_mark = self.ours.total()

    def on_train_batch_end(self, *args: Any) -> None:
        self.steps.append(self.ours.total() - self._step_mark)

    def on_train_epoch_start(self, *args: Any) -> None:
        self._marks = (self.all.copy(), self.ours.copy())

    def on_train_epoch_end(self, *args: Any) -> None:
        ours = self.ours - self._marks[1]
        all_ = (self.all - self._marks[0]).total()
        self.epochs.append({"all": all_, "ours": ours.total(), "ours_by_name": dict(ours)})


class LossReading(pl.Callback):
    """Keeps how a ``GradFlowCallback``'s running fit reads the loss (put it after the callback)."""

    def __init__(self, watched: Any) -> None:
        self.watched = watched
        self.reading: str | None = None

    def on_train_batch_end(self, *args: Any) -> None:
        alarms = getattr(getattr(self.watched, "_fit", None), "alarms", None)
        if alarms is not None:  # a StatsCallback, or alarms=False, reads no loss: None
            self.reading = alarms.loss_agreement.reading


def _called_from_package() -> bool:
    import lightning_hooks

    root = str(Path(lightning_hooks.__file__).parent)
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(root):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False
