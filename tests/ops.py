"""Count the ATen operations dispatched while a window is open, with a ``TorchDispatchMode``.

Unlike a ``TorchFunctionMode`` (see ``syncs.py``), a dispatch mode also sees the operations run
inside autograd's backward on the CPU, tensor hooks included: measured on torch 2.13, a
``vector_norm`` in a tensor hook on an activation is counted. The window can be opened and closed
from different callback hooks (``start`` / ``stop``), as long as they run on one thread.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytorch_lightning as pl
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts every ATen operation (by name) dispatched while it is started."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.running = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    def start(self) -> None:
        if not self.running:
            self.__enter__()
            self.running = True

    def stop(self) -> None:
        if self.running:
            self.__exit__(None, None, None)
            self.running = False

    @property
    def total(self) -> int:
        return sum(self.ops.values())


class OpsPerStep(pl.Callback):
    """Counts the ATen ops of every training step (batch start to the next batch start)."""

    def __init__(self) -> None:
        self.counter = OpCounter()
        self.per_step: list[int] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self._close()
        self.counter.start()

    def on_train_epoch_end(self, *args: Any) -> None:
        self._close()

    def _close(self) -> None:
        if self.counter.running:
            self.counter.stop()
            self.per_step.append(self.counter.total)
            self.counter.ops.clear()
