"""The states of a :class:`~lightning_hooks.core.stats.stat.LayerStat` packed into one tensor,
pooled across ranks, and the windows of steps copied to the host and folded into the epoch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from lightning_hooks.core.transport.distributed import all_gather_stacked
from lightning_hooks.core.transport.readback import HostMailbox

__all__ = ["EpochWindows", "Kind", "Reduce", "StateSpec", "all_pool", "pack_dtype", "unpack"]

Reduce = Literal["sum", "max", "min", "same"]
Kind = Literal["layer", "unit", "global"]
"""How a state pools across ranks: ``"same"`` holds values every rank shares (bin edges)."""


@dataclass(frozen=True)
class StateSpec:
    """One declared state: ``[rows, *width]`` per layer, a flat run of entries per unit, or one
    ``[*width]`` tensor for the whole model (``kind="global"``)."""

    name: str
    reduce: Reduce
    dtype: torch.dtype
    width: tuple[int, ...] = ()
    kind: Kind = "layer"
    fill: float | None = None

    @property
    def identity(self) -> float:
        """The value of a fresh entry (and of a reset one, unless ``reduce == "same"``)."""
        if self.fill is not None:
            return self.fill
        if self.reduce in ("sum", "same"):
            return 0.0
        low, high = _extremes(self.dtype)
        return low if self.reduce == "max" else high


def _extremes(dtype: torch.dtype) -> tuple[float, float]:
    if dtype.is_floating_point:
        return -torch.inf, torch.inf
    if dtype == torch.bool:
        return 0.0, 1.0
    info = torch.iinfo(dtype)
    return float(info.min), float(info.max)


def pack_dtype(device: torch.device) -> torch.dtype:
    """The dtype every state is packed in on ``device`` (MPS has no float64)."""
    return torch.float32 if device.type == "mps" else torch.float64


def unpack(host: np.ndarray, shapes: dict[str, torch.Size]) -> dict[str, np.ndarray]:
    """The packed states ``host`` as float64 arrays by name, in ``shapes``' order."""
    out, offset = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape, dtype=np.int64))
        out[name] = np.array(host[offset : offset + size], dtype=np.float64).reshape(shape)
        offset += size
    return out


def all_pool(
    tensors: Sequence[torch.Tensor],
    reduces: Sequence[Reduce],
    dtype: torch.dtype,
    process_group: Any = None,
) -> list[torch.Tensor]:
    """Each of ``tensors`` pooled across ranks with its reduce, in ONE all-gather of them all
    packed together in ``dtype`` (whatever their number and dtypes)."""
    packed = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    gathered = all_gather_stacked(packed, process_group)
    out, offset = [], 0
    for tensor, reduce in zip(tensors, reduces, strict=True):
        part = gathered[:, offset : offset + tensor.numel()]
        offset += tensor.numel()
        out.append(_pool(part, reduce).to(tensor.dtype).view_as(tensor))
    return out


def _pool(part: torch.Tensor, reduce: Reduce) -> torch.Tensor:
    """The ranks' copies ``part`` (stacked on the first axis) pooled with ``reduce``."""
    if reduce == "sum":
        return part.sum(0)
    if reduce == "max":
        return part.amax(0)
    if reduce == "min":
        return part.amin(0)
    return part[0]


def _pad(values: np.ndarray, shape: tuple[int, ...], spec: StateSpec) -> np.ndarray:
    """``values`` grown along its first axis to ``shape`` with fresh entries (rows only grow)."""
    if values.shape == shape:
        return values
    grown = np.full(shape, spec.identity, dtype=np.float64)
    grown[: values.shape[0]] = values
    return grown


def _combine(old: np.ndarray, new: np.ndarray, reduce: Reduce) -> np.ndarray:
    if reduce == "sum":
        return np.asarray(old + new)
    if reduce == "max":
        return np.asarray(np.maximum(old, new))
    if reduce == "min":
        return np.asarray(np.minimum(old, new))
    return new


class EpochWindows:
    """The windows of steps a statistic posts at logging points: ONE copy each to the host
    (pinned and non-blocking on CUDA, see :class:`~.readback.HostMailbox`), folded there into
    the epoch's states (sums added, extremes kept) and kept until read.

    Args:
        specs: the statistic's declared states, by name (read, never changed).
    """

    def __init__(self, specs: dict[str, StateSpec]) -> None:
        self.specs = specs
        self.epoch: dict[str, np.ndarray] | None = None  # the folded windows, reduced, on host
        self._mailbox: HostMailbox | None = None
        self._ready: list[tuple[int, dict[str, np.ndarray]]] = []  # folded, not yet read

    def post(self, packed: torch.Tensor, shapes: dict[str, torch.Size], step: int) -> None:
        """Start the copy of the window ``packed`` (reduced already) ended at ``step``."""
        box = self._mailbox
        if box is None or box.shape != tuple(packed.shape):
            box = self._mailbox = HostMailbox(tuple(packed.shape), packed.device, packed.dtype)
        box.post(packed, meta=(step, shapes))

    def collect(self, wait: bool) -> None:
        """Fold the posted window into the epoch once its copy is done (``wait``: block for it)
        and keep it for :meth:`pop`: a reduce in between (a checkpoint) loses nothing."""
        got = None if self._mailbox is None else self._mailbox.read(wait)
        if got is not None:
            view, (step, shapes) = got
            states = unpack(view, shapes)
            self._fold(states)
            self._ready.append((step, states))

    @property
    def in_flight(self) -> bool:
        """Whether a window was posted and not yet read by :meth:`pop`."""
        return bool(self._ready) or (self._mailbox is not None and self._mailbox.pending)

    def pop(self) -> tuple[int, dict[str, np.ndarray]] | None:
        """The oldest folded window not yet read, ``None`` when none is."""
        return self._ready.pop(0) if self._ready else None

    def _fold(self, states: dict[str, np.ndarray]) -> None:
        """Add a window's host states into the epoch's (sums added, extremes kept)."""
        if self.epoch is None:
            self.epoch = {k: v.copy() for k, v in states.items()}
            return
        for name, new in states.items():
            spec = self.specs[name]
            old = _pad(self.epoch[name], new.shape, spec)
            self.epoch[name] = _combine(old, new, spec.reduce)

    def with_epoch(self, window: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The epoch's folded windows and the current ``window`` together."""
        if self.epoch is None:
            return window
        return {
            name: _combine(_pad(self.epoch[name], new.shape, self.specs[name]), new, spec.reduce)
            for (name, new), spec in zip(window.items(), self.specs.values(), strict=True)
        }

    def clear(self) -> None:
        """A new epoch: the folded windows and a window still in flight dropped."""
        self.epoch, self._ready = None, []
        if self._mailbox is not None:
            self._mailbox.clear()

    def forget(self) -> None:
        """As new: the mailbox too (the states may change shape or device)."""
        self.epoch, self._mailbox, self._ready = None, None, []
