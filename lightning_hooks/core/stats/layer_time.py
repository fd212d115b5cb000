"""Timing of each layer's forward pass at logging steps.

The clock is ``perf_counter`` on the CPU, CUDA events on a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.hooks.registry import HookRegistry
from lightning_hooks.core.hooks.selection import ModuleTypes, Patterns, Selection
from lightning_hooks.core.ops.tensors import is_training_forward
from lightning_hooks.core.stats.stat import LayerStat
from lightning_hooks.tags import LAYER_TIME, family_tag, layer_tag

__all__ = ["LayerTimer", "LayerTimes"]


@dataclass(frozen=True)
class LayerTimes:
    """The timings over the logging steps since the last reset.

    Attributes:
        layers: layer names, model order.
        forward_ms: mean forward time of each layer per logging step, every call counted (ms).
        calls: forward calls of each layer, over all logging steps.
        step_ms: mean wall time of a logging step (ms), ``NaN`` when none was bracketed.
        steps: number of logging steps.
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


Mark = float | torch.cuda.Event
"""A clock reading: ``perf_counter``'s seconds, or a CUDA event recorded on the stream."""


class _Span(NamedTuple):
    """Two readings of the clock: a layer's forward, or a logging step's batch."""

    start: Mark
    end: Mark


class _LayerSpan(NamedTuple):
    """One forward call of the layer in row ``row``."""

    row: int
    span: _Span


@dataclass(frozen=True)
class _Clock:
    """Reads ``perf_counter``, or records CUDA events on the current stream (read after a sync)."""

    cuda: bool

    def mark(self) -> Mark:
        """Return a reading now.

        Returns:
            A ``perf_counter`` reading, or a recorded CUDA event.
        """
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    @staticmethod
    def elapsed_ms(span: _Span) -> float:
        """Return the milliseconds from ``span.start`` to ``span.end`` (CUDA: both events done).

        Args:
            span: the two readings.

        Returns:
            The milliseconds between them.
        """
        start = span.start
        end = span.end
        if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            return float(start.elapsed_time(end))
        assert isinstance(start, float) and isinstance(end, float)  # one clock marks both
        return (end - start) * 1e3


@named_arguments
class LayerTimer(LayerStat[LayerTimes]):
    """Times the forward of every selected layer at logging steps (not the backward).

    CUDA events are read at the next logging step. Only leaf modules by default, so no time
    counts twice.

    Args:
        model: the model to time now (``None``: call :meth:`attach` later).
        types: only modules of these types (``None``: any).
        include: glob patterns on qualified module names to keep (``None``: every name).
        exclude: glob patterns on qualified module names to drop.
        leaves: keep only modules without children.
        cuda: use CUDA events (``None``: where the model runs on a CUDA device, by its
            ``device`` where it has one, as a ``LightningModule`` does, else by its parameters).
        owner: the public name errors give.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> timer = LayerTimer(model)
        >>> timer.start_step()
        >>> _ = model(torch.randn(4, 8))
        >>> timer.end_step()
        >>> _ = model(torch.randn(4, 8))  # not a logging step: not timed
        >>> times = timer.result()
        >>> times.layers, times.steps, times.calls.tolist()
        (('0', '1', '2'), 1, [1, 1, 1])
        >>> timer.remove()
    """

    forward_ms: torch.Tensor
    calls: torch.Tensor
    step_ms: torch.Tensor
    steps: torch.Tensor

    def __init__(  # noqa: PLR0913 (a public constructor: one keyword per option)
        self,
        model: nn.Module | None = None,
        *,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
        leaves: bool = True,
        cuda: bool | None = None,
        owner: str = "LayerTimer",
    ) -> None:
        super().__init__(Selection.of(owner, types=types, include=include, exclude=exclude))
        self.leaves = leaves
        self.use_cuda = cuda
        self.sampling = False
        self._clock = _Clock(cuda=False)
        self.add_layer_state("forward_ms", reduce="sum")
        self.add_layer_state("calls", reduce="sum")
        self.add_layer_state("step_ms", reduce="sum", width=(1,), kind="global")
        self.add_layer_state("steps", reduce="sum", width=(1,), kind="global")
        self._clear_host()
        if model is not None:
            self.attach(model)

    def _clear_host(self) -> None:
        """Forget the host totals and this step's marks, sized to the rows."""
        n = len(self.rows)
        self._open: list[Mark | None] = [None] * n  # each layer's running forward's start
        self._ms = np.zeros(n)
        self._calls = np.zeros(n)
        self._step_ms = np.zeros(1)
        self._steps = np.zeros(1)
        self._marks: list[_LayerSpan] = []  # this step's layer marks
        self._brackets: list[_Span] = []  # this step's batches
        self._last_step: int | None = None
        self._step_start: Mark | None = None

    def select(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Return the selected modules to time: only leaves unless ``leaves`` is false.

        Args:
            model: the model the modules are selected from.

        Returns:
            ``(name, module)`` of each module to time.
        """
        assert self.selection is not None
        where = (lambda _n, m: next(m.children(), None) is None) if self.leaves else None
        return self.selection.modules(model, where=where)

    def _attached(self, model: nn.Module, registry: HookRegistry) -> None:
        """Choose the clock for the hooked model and clear the host totals."""
        cuda = self.use_cuda
        self._clock = _Clock(_runs_on_cuda(model) if cuda is None else cuda)
        self._clear_host()

    def hook_module(self, registry: HookRegistry, name: str, module: nn.Module) -> None:
        """Register the pre- and post-forward hooks that time one module while sampling.

        Args:
            registry: the registry the hooks go on.
            name: the module's qualified name, its row's name.
            module: the module timed.
        """
        index = self.row(name)  # rows in model order, made as the hooks are

        def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
            if self.sampling and is_training_forward(module):
                self._open[index] = self._clock.mark()

        def post(module: nn.Module, args: tuple[Any, ...], output: object) -> None:
            start = self._open[index]
            if self.sampling and start is not None:
                self._open[index] = None
                span = _Span(start=start, end=self._clock.mark())
                self._marks.append(_LayerSpan(row=index, span=span))

        registry.forward_pre_hook(module, pre, gated=True)
        registry.forward_hook(module, post, gated=True)

    def start_step(self, step: int | None = None) -> None:
        """Start timing a batch of a logging step.

        Args:
            step: the logging step; micro-batches of one ``step`` add up into it.
        """
        self._fold_events()
        if step is None or step != self._last_step:
            self._steps += 1
        self._last_step = step
        self.sampling = True
        self._step_start = self._clock.mark()

    def end_step(self) -> None:
        """End the logging step's batch (a no-op when none is open)."""
        if not self.sampling:
            return
        assert self._step_start is not None  # set by start_step, with sampling
        self._brackets.append(_Span(start=self._step_start, end=self._clock.mark()))
        self.sampling = False
        self._open = [None] * len(self.rows)
        if not self._clock.cuda:
            self._fold_events()

    def _fold_events(self) -> None:
        """Add the last logging step's marks to the host totals (CUDA: waits for its end)."""
        if self._clock.cuda:
            if not self._brackets:
                return
            last = self._brackets[-1].end
            assert isinstance(last, torch.cuda.Event)  # the CUDA clock marks with events
            last.synchronize()
        for mark in self._marks:
            self._ms[mark.row] += self._clock.elapsed_ms(mark.span)
            self._calls[mark.row] += 1
        self._step_ms += sum(self._clock.elapsed_ms(bracket) for bracket in self._brackets)
        self._marks = []
        self._brackets = []

    def drain(self) -> None:
        """Fold the host totals into the states.

        A step cut short (a skipped batch's) ends here.
        """
        self.end_step()
        self._fold_events()
        if not self._steps[0] and not self._calls.any():
            return
        # One host-to-device copy of the four totals (torch.tensor would keep ~1 kB of noise).
        host = np.concatenate([self._ms, self._calls, self._step_ms, self._steps])
        totals = torch.from_numpy(host).to(self.forward_ms.device)
        states = (self.forward_ms, self.calls, self.step_ms, self.steps)
        parts = torch.split(totals, [len(self._ms)] * 2 + [1, 1])
        for state, part in zip(states, parts, strict=True):
            state.add_(part)
        self._ms[:] = 0.0
        self._calls[:] = 0.0
        self._step_ms[:] = 0.0
        self._steps[:] = 0.0

    def summarize(self, states: dict[str, np.ndarray]) -> LayerTimes:
        """Turn the reduced host states into the timings.

        Args:
            states: the time and call states, reduced across ranks.

        Returns:
            The timings since the last reset.
        """
        steps = int(states["steps"][0])
        return LayerTimes(
            layers=self.layers,
            forward_ms=states["forward_ms"] / max(steps, 1),
            calls=states["calls"].astype(np.int64),
            step_ms=float(states["step_ms"][0] / steps) if steps else float("nan"),
            steps=steps,
        )

    def tags(self, result: LayerTimes) -> dict[str, float]:
        """Return ``layer_time/{forward_ms,share}/{layer}``, ``step_ms`` and ``forward_share``.

        Args:
            result: the timings.

        Returns:
            The scalars, by tag.
        """
        if result.steps == 0:
            return {}
        share = result.share
        out = dict[str, float]()
        for i in np.flatnonzero(result.calls):
            layer = result.layers[i]
            out[layer_tag(LAYER_TIME, "forward_ms", layer)] = float(result.forward_ms[i])
            out[layer_tag(LAYER_TIME, "share", layer)] = float(share[i])
        out[family_tag(LAYER_TIME, "step_ms")] = result.step_ms
        out[family_tag(LAYER_TIME, "forward_share")] = float(share.sum())
        return out

    def reset(self) -> None:
        """Forget every time (call after :meth:`result`, once per logging period)."""
        super().reset()
        self._last_step = None

    def remove(self) -> None:
        """Remove every hook (idempotent) and stop sampling."""
        super().remove()
        self.sampling = False


def _runs_on_cuda(model: nn.Module) -> bool:
    """Return whether ``model`` runs on a CUDA device.

    A module that says where it runs (a ``LightningModule``'s ``device``) is taken at its word,
    so that one with no parameter on the device is timed on it too; another module runs where
    a parameter of it is.
    """
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return any(p.is_cuda for p in model.parameters())
