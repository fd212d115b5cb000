"""Count host syncs made from the library's own code: ``item``, ``tolist``, ``cpu``, ``numpy``,
``__bool__`` on any tensor, wherever they run (autograd hooks included).

A ``TorchFunctionMode`` would be the natural tool, but modes do not reach code that runs inside
autograd's backward (tensor hooks): measured on torch 2.13, a ``.item()`` in a tensor hook is not
seen by an active mode. So the methods are wrapped on ``torch.Tensor`` itself for the duration.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

import lightning_hooks

SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__")
PACKAGE_DIR = str(Path(lightning_hooks.__file__).parent)


class SyncCounter:
    """Counts sync calls whose call stack passes through files under ``root``."""

    def __init__(self, root: str = PACKAGE_DIR) -> None:
        self.root = root
        self.active = False
        self.calls: Counter[str] = Counter()

    def _from_root(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(self.root):
                return True
            frame = frame.f_back  # type: ignore[assignment]
        return False

    def record(self, name: str) -> None:
        if self.active and self._from_root():
            self.calls[name] += 1


@contextmanager
def count_syncs(monkeypatch: pytest.MonkeyPatch, root: str = PACKAGE_DIR) -> Iterator[SyncCounter]:
    counter = SyncCounter(root)
    for name in SYNC_METHODS:
        original = getattr(torch.Tensor, name)

        def wrapper(self: torch.Tensor, *args: Any, _o: Any = original, _n: str = name) -> Any:
            # Pinned host memory is a host copy: its numpy view is made once, when the copy is,
            # and read once the copy has landed; no device is waited for (on an H100 these were
            # the 5 "syncs" of 4 steps at the defaults, all HostCopy.__init__).
            if not (self.device.type == "cpu" and self.is_pinned()):
                counter.record(_n)
            return _o(self, *args)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    yield counter


class SyncWindow(pl.Callback):
    """Opens a :class:`SyncCounter` from each epoch's start until just before the epoch-end
    logging (put it first in the callbacks list, so its epoch end runs before theirs)."""

    counter: Any = None
    windows = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.counter.active = True

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.counter.active = False
        self.windows += 1
