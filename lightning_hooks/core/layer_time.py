"""Forward time per layer on sampled steps: ``perf_counter`` on the CPU, CUDA events on a GPU."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_hooks.core.registry import HookRegistry
from lightning_hooks.core.selection import ModuleTypes, Patterns
from lightning_hooks.core.tensors import is_training_forward

__all__ = ["LayerTimer", "LayerTimes"]


@dataclass(frozen=True)
class LayerTimes:
    """Host-side timings over the sampled steps since the last reset.

    Attributes:
        layers: layer names, model order.
        forward_ms: forward time of each layer per sampled step, milliseconds (mean over steps;
            a layer called twice in a step counts both calls).
        calls: forward calls of each layer, over all sampled steps.
        step_ms: wall time of a sampled step, milliseconds (mean), or ``NaN`` when no step was
            bracketed by :meth:`LayerTimer.start_step` / :meth:`LayerTimer.end_step`.
        steps: number of sampled steps.
    """

    layers: tuple[str, ...]
    forward_ms: np.ndarray
    calls: np.ndarray
    step_ms: float
    steps: int

    @property
    def share(self) -> np.ndarray:
        """Each layer's forward time as a fraction of the step."""
        return self.forward_ms / self.step_ms


class _CpuClock:
    """Wall-clock marks: a ``perf_counter`` reading taken when the mark is made."""

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return (float(end) - float(start)) * 1e3


class _CudaClock:
    """CUDA events recorded on the current stream; read once, after one synchronize."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end))


class LayerTimer:
    """Times the forward of every selected layer on the steps the caller samples.

    Forward pre- and post-hooks (through a :class:`HookRegistry`) bracket each layer's forward.
    On steps that are not sampled every hook returns after one Python attribute check: no
    clock read, no allocation. On the CPU a mark is a ``time.perf_counter()`` reading; on a CUDA
    device a mark is a CUDA event recorded on the current stream, and the events are read only in
    :meth:`result`, after one synchronize: no host sync on any step. Only training forwards count
    (not ``no_grad``/eval forwards, not activation-checkpoint recomputes).

    By default only *leaf* modules (no child modules) are timed, so that no time is counted twice
    and the layers' times sum to at most the forward. Backward time per layer is not measured:
    it would need full backward hooks, which break in-place ops and cost several times a forward
    hook.

    Args:
        model: the model.
        types: only modules of these types.
        include: glob patterns on qualified names to keep.
        exclude: glob patterns on qualified names to drop.
        leaves: keep only modules without children.
        cuda: use CUDA events (``None``: when a parameter of the model is on a CUDA device).

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> timer = LayerTimer(model)
        >>> timer.start_step()
        >>> _ = model(torch.randn(4, 8))
        >>> timer.end_step()
        >>> _ = model(torch.randn(4, 8))  # not sampled: not timed
        >>> times = timer.result()
        >>> times.layers, times.steps, times.calls.tolist()
        (('0', '1', '2'), 1, [1, 1, 1])
        >>> bool((times.forward_ms > 0).all() and times.forward_ms.sum() <= times.step_ms)
        True
        >>> timer.remove()
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
        leaves: bool = True,
        cuda: bool | None = None,
    ) -> None:
        if cuda is None:
            cuda = any(p.is_cuda for p in model.parameters())
        self._clock: _CpuClock | _CudaClock = _CudaClock() if cuda else _CpuClock()
        self._hooks = HookRegistry(model)
        where = (lambda _n, m: next(m.children(), None) is None) if leaves else None
        selected = self._hooks.modules(types=types, include=include, exclude=exclude, where=where)
        self.layers = tuple(name for name, _ in selected)
        self.sampling = False
        self._open: list[Any] = [None] * len(self.layers)
        self._marks: list[tuple[int, Any, Any]] = []
        self._steps: list[tuple[Any, Any]] = []
        self._step_start: Any = None
        for index, (_, module) in enumerate(selected):
            self._hooks.forward_pre_hook(module, self._pre_hook(index))
            self._hooks.forward_hook(module, self._post_hook(index))

    def _pre_hook(self, index: int) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self.sampling and is_training_forward(module):
                self._open[index] = self._clock.mark()

        return hook

    def _post_hook(self, index: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            start = self._open[index]
            if self.sampling and start is not None:
                self._marks.append((index, start, self._clock.mark()))
                self._open[index] = None

        return hook

    def start_step(self) -> None:
        """Start timing a sampled step: layers' forwards count until :meth:`end_step`."""
        self.sampling = True
        self._step_start = self._clock.mark()

    def end_step(self) -> None:
        """End the sampled step (a no-op when none is open)."""
        if not self.sampling:
            return
        self._steps.append((self._step_start, self._clock.mark()))
        self.sampling = False
        self._open = [None] * len(self.layers)

    def result(self) -> LayerTimes:
        """Read the marks (one synchronize on CUDA) into per-step means."""
        if isinstance(self._clock, _CudaClock) and (self._marks or self._steps):
            torch.cuda.synchronize()
        total = np.zeros(len(self.layers))
        calls = np.zeros(len(self.layers), dtype=np.int64)
        for index, start, end in self._marks:
            total[index] += self._clock.elapsed_ms(start, end)
            calls[index] += 1
        steps = len(self._steps)
        step_ms = [self._clock.elapsed_ms(start, end) for start, end in self._steps]
        return LayerTimes(
            layers=self.layers,
            forward_ms=total / max(steps, 1),
            calls=calls,
            step_ms=float(np.mean(step_ms)) if steps else float("nan"),
            steps=steps,
        )

    def reset(self) -> None:
        """Forget every mark (call after :meth:`result`, once per logging period)."""
        self._marks, self._steps = [], []

    def remove(self) -> None:
        """Remove every hook (idempotent) and stop sampling."""
        self._hooks.remove()
        self.sampling = False
        self.reset()
