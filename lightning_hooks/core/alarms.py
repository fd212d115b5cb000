"""Early warnings on gradients, evaluated on the device at every optimizer step: no Lightning here.

The rules run as a handful of kernels on the per-layer gradient statistics the
:class:`~lightning_hooks.core.GradFlowTracker` already computes. Their verdict is one small
``[2 * rules + 1, layers + 1]`` tensor that is copied to host memory without blocking and read on
the host later (see :class:`_Mailbox`): the steps where nothing is wrong pay no host sync.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lightning_hooks.core.grad_stats import GRAD_STATS

__all__ = ["ALARM_RULES", "AlarmRules", "GradientAlarm", "GradientAlarms"]

ALARM_RULES = ("spike", "absolute", "vanishing", "nonfinite", "amp_overflow")
"""Names of the rules, in the order of :attr:`GradientAlarms.counts`."""

_SPIKE, _ABSOLUTE, _VANISHING, _NONFINITE, _AMP = range(len(ALARM_RULES))
_NORM = GRAD_STATS.index("grad_norm")
_BAD = GRAD_STATS.index("grad_nonfinite")
_WEIGHT = GRAD_STATS.index("weight_norm")


def _positive(name: str, value: Any, integer: bool = False) -> None:
    ok = value is None or (value > 0 and math.isfinite(value))
    if integer:
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    if not ok:
        kind = "a positive int" if integer else "a positive finite float or None"
        raise ValueError(f"AlarmRules({name}={value!r}): must be {kind}, got {value!r}")


@dataclass(frozen=True)
class AlarmRules:
    """Which gradient alarms are on, and their thresholds. Every rule but ``absolute`` is on.

    Args:
        spike_factor: *spike*: a layer's (or the global) gradient norm exceeds this many times
            its running median over the last ``window`` optimizer steps. ``None`` turns it off.
            The default, 50, sits above what healthy small-batch training reaches (21.9x at
            most on a batch-of-8 MLP over 12 seeds x 200 steps) and far below an explosion.
        window: optimizer steps in the running median.
        min_history: the spike rule waits until a layer has this many finite steps of history.
        max_grad_norm: *absolute*: the global gradient norm exceeds this value (off by default).
        vanish_fraction: *vanishing*: a layer's gradient norm is below this fraction of the
            median layer's norm ... ``None`` turns it off.
        vanish_steps: ... for this many consecutive optimizer steps.
        nonfinite: *nonfinite*: a NaN/Inf in a gradient or in a layer's weights.
        every_n_steps: also evaluate the rules on optimizer steps ``0, n, 2n, ...`` between the
            steps whose statistics are sampled (``None``, the default: on the sampled steps only; 1:
            every step). Such a step costs one L2 pass over the gradients, one over the weights and
            the rules' kernels (measured: 1.13-1.20x of a step on the README's wide MLP on CPU,
            where a step is parameter-bound). ``window``, ``min_history`` and ``vanish_steps`` count
            evaluated steps.

    Example:
        >>> AlarmRules(spike_factor=20.0).window
        50
        >>> AlarmRules(window=0)
        Traceback (most recent call last):
        ...
        ValueError: AlarmRules(window=0): must be a positive int, got 0
    """

    spike_factor: float | None = 50.0
    window: int = 50
    min_history: int = 10
    max_grad_norm: float | None = None
    vanish_fraction: float | None = 1e-3
    vanish_steps: int = 20
    nonfinite: bool = True
    every_n_steps: int | None = None

    def __post_init__(self) -> None:
        for name in ("window", "min_history", "vanish_steps"):
            _positive(name, getattr(self, name), integer=True)
        if self.every_n_steps is not None:
            _positive("every_n_steps", self.every_n_steps, integer=True)
        for name in ("spike_factor", "max_grad_norm", "vanish_fraction"):
            _positive(name, getattr(self, name))
        if self.min_history > self.window:
            raise ValueError(
                f"AlarmRules(min_history={self.min_history}): must be at most "
                f"window={self.window}, got {self.min_history}"
            )


@dataclass(frozen=True)
class GradientAlarm:
    """One rule firing at one optimizer step, as read on the host.

    Attributes:
        rule: one of :data:`ALARM_RULES`.
        layer: the layer the alarm names (``"global"`` for all layers together).
        step: the optimizer step (0-based) whose gradients fired it.
        value: the gradient norm that fired it.
        reference: what it was compared with (running median, threshold, weight norm).
        message: the whole story in one line.
        others: the other layers the rule flagged at the same step.
    """

    rule: str
    layer: str
    step: int
    value: float
    reference: float
    message: str
    others: tuple[str, ...] = field(default=())


class _Mailbox:
    """A small device tensor copied to host memory without blocking, read on a later call.

    On CUDA the host buffer is pinned, the copy is ``non_blocking`` and an event marks its end:
    :meth:`read` does not wait unless asked to (``wait``: at most for the copy posted one step
    earlier). On the CPU the copy is the read. The host buffer's numpy view is made once here,
    so reading it is plain host memory access: no torch call, no sync, on any step.
    """

    def __init__(self, shape: tuple[int, ...], device: torch.device) -> None:
        cuda = device.type == "cuda"
        self._host = torch.zeros(shape, pin_memory=cuda)
        self._view: np.ndarray = self._host.numpy()
        self._event = torch.cuda.Event() if cuda else None  # type: ignore[no-untyped-call]
        self._meta: Any = None

    def post(self, value: torch.Tensor, meta: Any) -> None:
        # Only CUDA gets an event to tell when a non_blocking copy is done: elsewhere, block.
        self._host.copy_(value, non_blocking=self._event is not None)
        if self._event is not None:
            self._event.record()
        self._meta = meta

    def read(self, wait: bool) -> tuple[np.ndarray, Any] | None:
        """The posted value and its ``meta`` once the copy is done, else ``None``."""
        if self._meta is None:
            return None
        if self._event is not None:
            if wait:
                self._event.synchronize()
            elif not self._event.query():  # type: ignore[no-untyped-call]
                return None
        meta, self._meta = self._meta, None
        return self._view, meta


class GradientAlarms:
    """Evaluates :class:`AlarmRules` on each optimizer step's gradient norms, on the device.

    Rows are layers and a last ``"global"`` row. :meth:`update` (no host sync) applies the rules:

    - *spike*: ``norm > spike_factor * median`` of the row's last ``window`` finite norms (the
      lower median of an even count), once it has ``min_history`` of them (global row and each
      layer);
    - *absolute*: global ``norm > max_grad_norm``;
    - *vanishing*: a layer's ``norm < vanish_fraction * median over layers`` for
      ``vanish_steps`` consecutive steps (fires once per such run);
    - *nonfinite*: a NaN/Inf gradient or weight. The alarm names the first layer in forward
      order whose *weights* are non-finite (where a NaN entered the forward), else the first
      layer in backward order whose gradient is (the order the output-gradient hooks fired;
      reverse model order without them);
    - *amp_overflow*: with ``amp=True`` (a GradScaler), non-finite gradients mean the scaler
      skips the step: counted as an overflow, not a spike or a nonfinite alarm, and kept out of
      the running medians.

    :meth:`poll` reads the verdicts on the host: at once on the CPU; on CUDA when the copy is
    done, at the latest at the next :meth:`update` (one step late) or with ``wait=True``.

    Args:
        layers: row names: the layers, then ``"global"``.
        rules: the rules and thresholds.
        device: where the statistics live.

    Example:
        >>> alarms = GradientAlarms(["a", "b", "global"], AlarmRules(min_history=2, window=4))
        >>> norms = [[1.0, 2.0, 2.2], [1.1, 2.1, 2.4], [0.9, 1.9, 2.1], [1.0, 200.0, 200.0]]
        >>> for step, norm in enumerate(norms):
        ...     stats = torch.zeros(3, 5)
        ...     stats[:, 0] = torch.tensor(norm)
        ...     alarms.update(stats, torch.arange(3), step=step)
        >>> [(a.rule, a.layer, a.step, a.others) for a in alarms.poll()]
        [('spike', 'b', 3, ('global',))]
        >>> alarms.counts["spike"]
        2
    """

    def __init__(
        self, layers: Sequence[str], rules: AlarmRules | None = None, device: Any = None
    ) -> None:
        self.layers = tuple(layers)
        self.rules = rules if rules is not None else AlarmRules()
        device = torch.device(device) if device is not None else torch.device("cpu")
        n = len(self.layers)
        self._history = torch.full((self.rules.window, n), torch.nan, device=device)
        self._seen = torch.zeros(n, dtype=torch.long, device=device)
        self._low = torch.zeros(n - 1, dtype=torch.long, device=device)
        self._rows = torch.arange(n, device=device)
        self._all = torch.ones(n, dtype=torch.bool, device=device)
        self._mailbox = _Mailbox((2 * len(ALARM_RULES) + 1, n), device)
        self.counts: dict[str, int] = dict.fromkeys(ALARM_RULES, 0)
        """Flagged (layer, step) pairs per rule since :meth:`take_epoch`, on the host."""
        self.log: list[GradientAlarm] = []
        """Every alarm since :meth:`take_epoch`, one per rule and step."""
        self._new: list[GradientAlarm] = []

    @torch.no_grad()
    def update(
        self,
        stats: torch.Tensor,
        rows: torch.Tensor,
        *,
        step: int,
        amp: bool = False,
        order: Sequence[int] = (),
    ) -> None:
        """Apply the rules to one optimizer step (no host sync) and post the verdict.

        Args:
            stats: ``[len(rows), GRAD_STATS]`` statistics from
                :func:`~lightning_hooks.core.grad_stats.grad_stats`, last row global.
            rows: the rows ``stats`` covers (the layers one optimizer steps, then global). When
                they are not every layer, the global row is left out of the rules.
            step: the optimizer step, for the messages.
            amp: a GradScaler is active: non-finite gradients are an overflow it skips.
            order: layer rows in the order their output-gradient hooks fired.
        """
        self._drain(wait=True)  # the previous step's verdict: at most one step late
        norm, weight, active, bad = self._rows_of(stats, rows)
        overflow = bad.any() & amp
        flags, refs = self._evaluate(norm, weight, active, bad, overflow)
        keep = active & torch.isfinite(norm) & ~overflow
        slot = self._seen % self.rules.window
        self._history[slot, self._rows] = torch.where(keep, norm, self._history[slot, self._rows])
        self._seen += keep
        report = torch.cat([flags.float(), norm[None], refs])
        self._mailbox.post(report, (step, tuple(dict.fromkeys(order))))

    def _rows_of(
        self, stats: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norms, weight norms, which rows were stepped and which have non-finite gradients."""
        n = len(self.layers)
        if rows.numel() == n:  # the usual case, one optimizer stepping every layer: no scatter
            return stats[:, _NORM], stats[:, _WEIGHT], self._all, stats[:, _BAD] > 0
        norm = stats.new_full((n,), torch.nan).index_copy_(0, rows, stats[:, _NORM])
        weight = stats.new_full((n,), torch.nan).index_copy_(0, rows, stats[:, _WEIGHT])
        # The global row of a subset (a GAN's generator, say) is not comparable from step to
        # step with another optimizer's: it stays out of the rules, its layers do not.
        active = torch.zeros_like(self._all).index_fill_(0, rows[:-1], True)
        bad = torch.zeros_like(active).index_copy_(0, rows, stats[:, _BAD] > 0)
        return norm, weight, active, bad

    def _evaluate(
        self,
        norm: torch.Tensor,
        weight: torch.Tensor,
        active: torch.Tensor,
        bad: torch.Tensor,
        overflow: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rules, n = self.rules, len(self.layers)
        flags = torch.zeros(len(ALARM_RULES), n, dtype=torch.bool, device=norm.device)
        refs = torch.full((len(ALARM_RULES), n), torch.nan, device=norm.device)
        ok = active & ~overflow
        if rules.spike_factor is not None:
            median = torch.nanmedian(self._history, dim=0).values  # the lower median
            ready = self._seen >= rules.min_history
            flags[_SPIKE] = ok & ready & (median > 0) & (norm > rules.spike_factor * median)
            refs[_SPIKE] = median
        if rules.max_grad_norm is not None:
            flags[_ABSOLUTE, -1] = ok[-1] & (norm[-1] > rules.max_grad_norm)
            refs[_ABSOLUTE, -1] = rules.max_grad_norm
        if rules.vanish_fraction is not None:
            floor = rules.vanish_fraction * torch.nanquantile(norm[:-1], 0.5)
            low = torch.where(norm[:-1] < floor, self._low + 1, 0)
            self._low.copy_(torch.where(ok[:-1], low, self._low))
            flags[_VANISHING, :-1] = ok[:-1] & (self._low == rules.vanish_steps)
            refs[_VANISHING, :-1] = floor
        if rules.nonfinite:
            broken = active & ~torch.isfinite(weight)
            flags[_NONFINITE, :-1] = (broken | (bad & ~overflow))[:-1]
            refs[_NONFINITE] = weight
        flags[_AMP, -1] = overflow
        return flags, refs

    def poll(self, wait: bool = False) -> list[GradientAlarm]:
        """Alarms read on the host since the last poll (``wait``: include the latest step)."""
        self._drain(wait)
        new, self._new = self._new, []
        return new

    def _drain(self, wait: bool) -> None:
        got = self._mailbox.read(wait)
        if got is None:
            return
        report, (step, order) = got
        k = len(ALARM_RULES)
        flags, norm, refs = report[:k], report[k], report[k + 1 :]
        if not flags.any():
            return
        for index, rule in enumerate(ALARM_RULES):
            hit = np.flatnonzero(flags[index])
            if hit.size:
                self.counts[rule] += int(hit.size)
                alarm = self._alarm(index, hit, norm, refs[index], step, order)
                self.log.append(alarm)
                self._new.append(alarm)

    def _alarm(
        self,
        index: int,
        hit: np.ndarray,
        norm: np.ndarray,
        ref: np.ndarray,
        step: int,
        order: tuple[int, ...],
    ) -> GradientAlarm:
        row = int(_culprit(index, hit, norm, ref, order, len(self.layers) - 1))
        layer, value, reference = self.layers[row], float(norm[row]), float(ref[row])
        others = tuple(self.layers[i] for i in hit if i != row)
        text = _describe(ALARM_RULES[index], layer, step, value, reference, self.rules)
        if others:
            text += f" (also flagged: {', '.join(others)})"
        return GradientAlarm(ALARM_RULES[index], layer, step, value, reference, text, others)

    def take_epoch(self) -> tuple[dict[str, int], list[GradientAlarm]]:
        """Counts and alarms since the last call (waits for the latest step), then resets."""
        self._drain(wait=True)
        counts, log = self.counts, self.log
        self.counts, self.log = dict.fromkeys(ALARM_RULES, 0), []
        return counts, log

    def state_dict(self) -> dict[str, Any]:
        """Running medians, vanishing counters and counts, on the host (for checkpoints)."""
        self._drain(wait=True)
        return {
            "layers": self.layers,
            "history": self._history.cpu(),
            "seen": self._seen.cpu(),
            "low": self._low.cpu(),
            "counts": dict(self.counts),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; layers and window must match this instance."""
        if tuple(state["layers"]) != self.layers:
            raise ValueError(
                f"GradientAlarms.load_state_dict: saved layers {tuple(state['layers'])!r} differ "
                f"from this model's {self.layers!r}"
            )
        if state["history"].shape != self._history.shape:
            raise ValueError(
                f"GradientAlarms.load_state_dict: saved window {state['history'].shape[0]} "
                f"differs from window={self.rules.window}"
            )
        self._history.copy_(state["history"])
        self._seen.copy_(state["seen"])
        self._low.copy_(state["low"])
        self.counts = {**dict.fromkeys(ALARM_RULES, 0), **state["counts"]}


def _culprit(
    index: int, hit: np.ndarray, norm: np.ndarray, ref: np.ndarray, order: Sequence[int], last: int
) -> int:
    """The row an alarm names among the flagged rows ``hit`` (``last`` is the global row)."""
    if index == _NONFINITE:
        broken = [int(i) for i in hit if not math.isfinite(ref[i])]
        if broken:
            return broken[0]  # forward order: where the NaN entered
        return _first_backward({int(i) for i in hit}, order, last)
    layers = hit[hit != last]
    if layers.size == 0:
        return last
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = norm[layers] / ref[layers]
    if index == _VANISHING:
        return int(layers[np.nanargmin(ratio)]) if np.isfinite(ratio).any() else int(layers[0])
    return int(layers[np.nanargmax(ratio)]) if np.isfinite(ratio).any() else int(layers[0])


def _backward(order: Sequence[int], last: int) -> Iterator[int]:
    yield from order
    yield from range(last - 1, -1, -1)


def _first_backward(flagged: set[int], order: Sequence[int], last: int) -> int:
    """First flagged row in backward order: hook order, then reverse model order."""
    return next(row for row in _backward(order, last) if row in flagged)


def _describe(rule: str, layer: str, step: int, value: float, ref: float, rules: AlarmRules) -> str:
    at = f"optimizer step {step}"
    if rule == "spike":
        # finite entries whose squares overflow float32 give an infinite norm: still a spike
        ratio = f"{value / ref:.3g}x" if math.isfinite(value) else "beyond float32,"
        return (
            f"gradient spike at {at}: {layer} grad norm {value:.4g} is {ratio} its "
            f"running median {ref:.4g} (spike_factor={rules.spike_factor}, window={rules.window})"
        )
    if rule == "absolute":
        return f"gradient norm above max_grad_norm at {at}: {layer} {value:.4g} > {ref:.4g}"
    if rule == "vanishing":
        return (
            f"vanishing gradient at {at}: {layer} grad norm {value:.4g} below {ref:.4g} "
            f"(vanish_fraction={rules.vanish_fraction} of the median layer's norm) for "
            f"{rules.vanish_steps} consecutive steps"
        )
    if rule == "nonfinite":
        if not math.isfinite(ref):
            return (
                f"non-finite weights at {at}: {layer} (first layer in forward order), "
                f"grad norm {value:.4g}"
            )
        return (
            f"non-finite gradient at {at}: {layer} (first layer in backward order), "
            f"grad norm {value:.4g}"
        )
    return f"AMP overflow at {at}, step skipped by the GradScaler (grad norm {value:.4g})"
