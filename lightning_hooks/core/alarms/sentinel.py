"""Early warnings on gradients, a sentinel run on the device at every optimizer step: no Lightning.

The rules read one ``[layers + 1]`` tensor of gradient L2 norms per step (the layers, then the
global norm), keep O(layers) state (a running scale per row: an EMA of the log-norm and of its
spread, as ZClip and OLMo-core's SkipStep do), and post a small verdict to host memory without
blocking (:class:`~.readback.HostMailbox`): a quiet step pays no host sync.
When a rule fires, the diagnosis runs on the host: which layer, the weights (read only then) and
the last ``history`` steps' norms from a device ring buffer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from lightning_hooks.core import checks
from lightning_hooks.core.transport.readback import HostMailbox

__all__ = ["ALARM_RULES", "AlarmRules", "GradientAlarm", "GradientAlarms"]

ALARM_RULES = (
    "spike",
    "explosion",
    "absolute",
    "vanishing",
    "nonfinite",
    "amp_overflow",
    "loss_spike",
    "diverging",
    "stall",
)
"""Names of the rules, in the order of :attr:`GradientAlarms.counts`."""

_SPIKE, _EXPLOSION, _ABSOLUTE, _VANISHING, _NONFINITE, _AMP, _LOSS, _DIVERGING, _STALL = range(
    len(ALARM_RULES)
)
# the loss report: loss_spike's flag, diverging's margin (it fires unless the margin is < 0: NaN
# for a non-finite loss), the loss, its running scale; then diverging's state: the loss's running
# mean, its mean absolute deviation, the best running mean, the first loss
_L_SPIKE, _L_DIVERGING, _L_VALUE, _L_SCALE, _L_MEAN, _L_DEV, _L_BEST, _L_FIRST = range(8)
_LEARNT_NOISE = 4.0  # diverging's noise bar shrinks by 1/4 of what the run has learnt

_ADVICE = {
    "spike": "one step: a transient if the next steps come back to scale (it counts in the "
    "spike score); if it repeats, clip gradients (gradient_clip_val) or lower the learning rate",
    "absolute": "clip gradients (gradient_clip_val) or lower the learning rate",
    "vanishing": "check that the layer is used and trainable, its initialisation and the "
    "activations that feed it",
    "nonfinite": "lower the learning rate, clip gradients, or train in bf16 / with a GradScaler",
    "loss_spike": "look at this step's batch; if it repeats, lower the learning rate",
    "diverging": "lower the learning rate, add warm-up, or clip gradients (gradient_clip_val)",
    "stall": "an adaptive optimizer's second moment poisoned by an explosion recovers only "
    "slowly: reset the optimizer's state (or resume from a checkpoint before it) and clip "
    "gradients (gradient_clip_val); check that the learning rate is what you meant",
}
# the stall report: its flag, the log of the update per unit of learning rate, its running level
# before this logging step and after it (the state)
_S_FLAG, _S_VALUE, _S_BEFORE, _S_LEVEL = range(4)
_STALL_LR_FLOOR = 0.01  # below this share of its peak, the LR is being decayed away: no stall
_STALL_ALPHA = 0.5  # the stall's level: an EMA over the last few logging steps
_GRAD_RULES = 6  # rows of flags in the gradient report; the loss has its own mailbox
_NORM, _SCALE, _BAND, _FLOOR = range(_GRAD_RULES, _GRAD_RULES + 4)

WeightNorms = Callable[[], torch.Tensor]
"""Returns ``[layers + 1]`` weight L2 norms (last: all); called on the host when a rule fired."""


@dataclass(frozen=True)
class AlarmRules:
    """Which gradient alarms are on, and their thresholds (the defaults come from the false-alarm
    and detection table of ``benchmarks/alarms.py``, in the README's "Early warnings").

    Args:
        spike_factor: *spike*: a layer's (or the global) gradient norm exceeds this many times its
            running scale (``exp`` of the EMA of its log-norm) and ``spike_sigmas`` spreads of
            the log-norm above it. ``None`` turns it off. Must be > 1.
        spike_sigmas: *spike*: how many running standard deviations of the log-norm the step must
            also be above the running mean (the spread makes noisy layers need more).
        explode_factor: *explosion*: a spike that reaches the optimizer: the gradient the
            optimizer applies (after ``gradient_clip_val``'s clipping, when the caller gives the
            clip), all layers together and the layer named, exceeds this many times its running
            scale (and ``spike_sigmas`` spreads above it): big enough to wreck SGD's weights or
            poison an adaptive optimizer's second moment (Adam's takes ``(1 - beta2) g**2``: at
            300x its scale, 90 times its usual size, so every update for thousands of steps is
            about 10 times too small). Warned under the default ``on_alarm="warn"`` (a smaller
            spike is only logged). ``None`` turns it off. Must be > 1.
        window: span, in evaluated steps, of the running scale: the EMA weight is
            ``2 / (window + 1)`` (the exact mean and variance over the first steps).
        min_history: the spike rules are armed once a row has this many finite steps.
        max_grad_norm: *absolute*: the global gradient norm exceeds this value (off by default).
        vanish_fraction: *vanishing*: a layer's gradient norm is exactly zero, or below this
            fraction of the median norm of the layers whose gradient is not zero ... ``None``
            turns it off.
        vanish_steps: ... for this many consecutive evaluated steps (fires once per such run).
        nonfinite: *nonfinite*: a NaN/Inf gradient norm (a NaN/Inf entry, or a norm beyond the
            gradient's dtype), naming the layer where it entered.
        every_n_steps: evaluate the rules on optimizer steps ``0, n, 2n, ...`` (1: every step).
        loss_factor: *loss_spike*: the training loss exceeds this many times its running scale
            (and ``spike_sigmas`` spreads above it); ``None`` (default) turns it off.
        diverge_ratio: *diverging*: the running mean of the training loss (an EMA over
            ``diverge_span`` steps) has risen above its best so far by ``diverge_ratio - 1``
            times the best's magnitude ... (a non-finite loss always fires); ``None`` turns it
            off. Must be > 1.
        diverge_giveback: ... and has given back at least this fraction of what it had learnt
            (the first step's loss minus the best), so a loss near zero does not fire on noise.
        diverge_noise: ... and the rise also clears ``(diverge_ratio - 1) * |best|`` by this many
            mean absolute deviations of the loss from its running mean (an EMA over
            ``2 * diverge_span`` steps, before this step), less a quarter of what it had learnt,
            so a noisy loss that learns little does not fire on its own swings; 0 turns the bar
            off.
        diverge_span: span, in steps, of the loss's running mean for *diverging*.
        stall_factor: *stall*: on a logging step, the typical size of the optimizer's update
            per unit of learning rate (the median ``|w_after - w_before| / lr`` over a sample of
            each tensor's entries) fell this many times below its
            running level (an EMA of its log over the last few logging steps): the optimizer no
            longer moves the weights as the learning rate says it should (a second moment
            poisoned by an explosion). Adaptive optimizers only (a per-coordinate second moment
            in their state): SGD's update is the gradient, which shrinks as a run converges; and
            only entries whose gradient is not zero (a dead unit stops by design). Not evaluated
            while the learning rate is under 1% of its
            peak (a schedule decaying it to zero). ``None`` turns it off. Must be > 1.
        history: steps of per-layer norms kept in the device ring buffer that an alarm reports.

    Example:
        >>> AlarmRules(spike_factor=20.0).window
        50
        >>> AlarmRules(spike_factor=0.5)
        Traceback (most recent call last):
        ...
        ValueError: AlarmRules(spike_factor=0.5): must be a finite real > 1.0, got 0.5
    """

    spike_factor: float | None = 10.0
    explode_factor: float | None = 300.0
    spike_sigmas: float = 4.0
    window: int = 50
    min_history: int = 3
    max_grad_norm: float | None = None
    vanish_fraction: float | None = 1e-3
    vanish_steps: int = 20
    nonfinite: bool = True
    every_n_steps: int = 1
    loss_factor: float | None = None
    history: int = 16
    diverge_ratio: float | None = 2.0
    diverge_giveback: float = 0.5
    diverge_noise: float = 1.0
    diverge_span: int = 4
    stall_factor: float | None = 100.0

    def __post_init__(self) -> None:
        owner = "AlarmRules"
        checked: dict[str, Any] = {
            "spike_sigmas": checks.positive_real(owner, "spike_sigmas", self.spike_sigmas),
            "nonfinite": checks.boolean(owner, "nonfinite", self.nonfinite),
        }
        checked["diverge_giveback"] = checks.real(
            owner, "diverge_giveback", self.diverge_giveback, low=0.0, high=1.0
        )
        checked["diverge_noise"] = checks.real(owner, "diverge_noise", self.diverge_noise, low=0.0)
        names = ("window", "min_history", "vanish_steps", "every_n_steps", "history")
        for name in (*names, "diverge_span"):
            checked[name] = checks.positive_int(owner, name, getattr(self, name))
        optional: dict[str, Callable[[str, Any], float]] = {
            "spike_factor": lambda n, v: checks.real(owner, n, v, low=1.0, low_open=True),
            "explode_factor": lambda n, v: checks.real(owner, n, v, low=1.0, low_open=True),
            "stall_factor": lambda n, v: checks.real(owner, n, v, low=1.0, low_open=True),
            "loss_factor": lambda n, v: checks.real(owner, n, v, low=1.0, low_open=True),
            "diverge_ratio": lambda n, v: checks.real(owner, n, v, low=1.0, low_open=True),
            "max_grad_norm": lambda n, v: checks.positive_real(owner, n, v),
            "vanish_fraction": lambda n, v: checks.real(
                owner, n, v, low=0.0, high=1.0, low_open=True, high_open=True
            ),
        }
        for name, check in optional.items():
            value = getattr(self, name)
            checked[name] = None if value is None else check(name, value)
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        if self.min_history > self.window:
            raise ValueError(
                f"AlarmRules(min_history={self.min_history}): must be at most "
                f"window={self.window}, got {self.min_history}"
            )

    @property
    def watches_loss(self) -> bool:
        """Whether a rule reads the training loss (*loss_spike* or *diverging*)."""
        return self.loss_factor is not None or self.diverge_ratio is not None


@dataclass(frozen=True)
class GradientAlarm:
    """One rule firing at one optimizer step, as read on the host.

    Attributes:
        rule: one of :data:`ALARM_RULES`.
        layer: the layer the alarm names (``"global"`` for all layers together, ``"loss"``).
        step: the optimizer step (0-based) whose gradients fired it.
        value: the gradient norm (or loss) that fired it.
        reference: what it was compared with (running scale, threshold, floor, weight norm).
        message: the whole story in one line.
        others: the other layers the rule flagged at the same step.
        history_steps: the optimizer steps in the ring buffer, oldest first, up to ``step``.
        history: per step of ``history_steps``, the gradient norm of every row (the layers,
            then the global norm), from the device ring buffer.
        history_scale: the same rows' running scales before each step (NaN: not armed yet).
        history_layers: the rows' names (the layers, then ``"global"``).
        departure: which layer left its running scale first (by more than the spike rule's
            band, up or down), when, and by how much; :meth:`history_lines` gives it step by
            step.
        departed: that layer's name (``""``: none left its scale in the ring buffer).
    """

    rule: str
    layer: str
    step: int
    value: float
    reference: float
    message: str
    others: tuple[str, ...] = field(default=())
    history_steps: tuple[int, ...] = field(default=())
    history: tuple[tuple[float, ...], ...] = field(default=())
    history_scale: tuple[tuple[float, ...], ...] = field(default=())
    history_layers: tuple[str, ...] = field(default=())
    departure: str = ""
    departed: str = ""

    def history_lines(self) -> list[str]:
        """Step by step, norm / running scale of the layer that left first, the layer named and
        the global row (``"-"``: not armed yet)."""
        names = dict.fromkeys(n for n in (self.departed, self.layer, "global") if n)
        rows = [self.history_layers.index(n) for n in names if n in self.history_layers]
        lines = []
        for step, norm, scale in zip(
            self.history_steps, self.history, self.history_scale, strict=True
        ):
            cells = [
                f"{self.history_layers[r]} {norm[r]:.4g} ({_ratio(norm[r] / scale[r])})"
                if math.isfinite(scale[r]) and scale[r] > 0
                else f"{self.history_layers[r]} {norm[r]:.4g} (-)"
                for r in rows
            ]
            lines.append(f"step {step}: " + ", ".join(cells))
        return lines


class _RunningScale:
    """Per row: EMA of ``log x`` and of its variance, and the count of finite steps seen.

    Written for few kernels: views of one state tensor made once, in-place updates.
    """

    def __init__(self, rows: int, rules: AlarmRules, device: torch.device) -> None:
        self.state = torch.zeros(3, rows, device=device)  # mean, variance, count
        self.mean, self.var, self.count = self.state.unbind(0)
        self.alpha = 2.0 / (rules.window + 1)
        self.armed_at = float(rules.min_history)
        self.sigmas = rules.spike_sigmas
        self._inf = torch.full((rows,), math.inf, device=device)

    def threshold(self, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``log`` of the spike threshold per row (``inf`` until armed), and whether armed."""
        armed = torch.ge(self.count, self.armed_at)
        band = self.var.sqrt().mul_(self.sigmas).clamp_min_(math.log(factor))
        return torch.where(armed, band.add_(self.mean), self._inf), armed

    def update(self, log_x: torch.Tensor, keep: torch.Tensor, ceiling: torch.Tensor) -> None:
        """Fold ``log_x`` into the rows where ``keep``. Above ``ceiling`` (a spike) only the
        mean moves, towards the ceiling: a lasting change of level is learnt in a few dozen
        steps, while the spread, which would otherwise grow with each spike, stays."""
        self.count.add_(keep)
        weight = self.count.clamp_min(1.0).reciprocal_().clamp_min_(self.alpha).mul_(keep)
        delta = torch.where(keep, torch.minimum(log_x, ceiling), self.mean).sub_(self.mean)
        spread = torch.mul(weight, torch.le(log_x, ceiling))
        self.mean.addcmul_(weight, delta)
        self.var.addcmul_(spread, delta.square()).mul_(torch.rsub(spread, 1.0))


class GradientAlarms:
    """Evaluates :class:`AlarmRules` on each optimizer step's gradient norms, on the device.

    Rows are layers and a last ``"global"`` row. :meth:`update` (a few dozen small kernels, no
    host sync) applies the rules to ``[layers + 1]`` L2 norms:

    - *spike*: ``log(norm) > mean + max(spike_sigmas * std, log(spike_factor))``, with the
      running mean and standard deviation of the row's log-norm (an EMA over about ``window``
      steps), once the row has ``min_history`` finite steps (global row and each layer). A spike
      is folded into the scale clamped at the threshold (as ZClip does), so a lasting change of
      level is learnt, not alarmed at every step;
    - *absolute*: global ``norm > max_grad_norm``;
    - *vanishing*: a layer's norm is exactly zero, or below ``vanish_fraction`` x the median
      norm of the layers whose norm is not zero, for ``vanish_steps`` consecutive steps (fires
      once per such run; when every layer is zero, every layer fires);
    - *nonfinite*: a NaN/Inf gradient norm. The alarm names the first layer in forward order
      whose *weights* are non-finite (where a NaN entered the forward; the weights are read on
      the host, only then), else the first layer in backward order whose gradient is (the order
      the output-gradient hooks fired; reverse model order without them);
    - *amp_overflow*: with ``amp=True`` (a GradScaler), non-finite gradients mean the scaler
      skips the step: counted as an overflow, not a spike or a nonfinite alarm, and kept out of
      the running scales;
    - *loss_spike* (off by default): :meth:`update_loss`'s loss against its own running scale;
    - *diverging*: :meth:`update_loss`'s loss, its running mean (EMA over ``diverge_span``
      steps) against its best so far and the first step's loss: ``mean - best >=
      (diverge_ratio - 1) * |best| + diverge_noise * max(dev - (first - best) / 4, 0)`` and
      ``mean - best >= diverge_giveback * (first - best)``, with ``dev`` the loss's mean
      absolute deviation from its running mean before this step (an EMA over ``2 *
      diverge_span`` steps), or a non-finite loss. Referenced from the first step (no blind
      start); a loss near zero does not fire on noise (it must give back a share of what it had
      learnt), nor does a noisy loss that learns little (it must rise beyond its own swings).

    A *spike* is a one-step fact (a transient, if the run recovers); *diverging* is the
    warning that the run is being lost. :attr:`spike_score` counts every alarm per 1,000
    evaluated steps.

    :meth:`poll` reads the verdicts on the host: at once on the CPU; on CUDA when the copy is
    done, at the latest at the next :meth:`update` (one step late) or with ``wait=True``.

    Args:
        layers: row names: the layers, then ``"global"``.
        rules: the rules and thresholds.
        device: where the statistics live.

    Example:
        >>> alarms = GradientAlarms(["a", "b", "global"], AlarmRules(min_history=3))
        >>> norms = [[1.0, 2.0, 2.2], [1.1, 2.1, 2.4], [0.9, 1.9, 2.1], [1.0, 200.0, 200.0]]
        >>> for step, norm in enumerate(norms):
        ...     alarms.update(torch.tensor(norm), step=step)
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
        if not isinstance(self.rules, AlarmRules):
            raise TypeError(f"GradientAlarms(rules={rules!r}): must be an AlarmRules or None")
        device = torch.device(device) if device is not None else torch.device("cpu")
        n = len(self.layers)
        self._scale = _RunningScale(n, self.rules, device)
        self._low = torch.zeros(n, dtype=torch.long, device=device)
        self._is_layer = torch.ones(n, dtype=torch.bool, device=device)
        self._is_layer[-1] = False
        self._not_layer = torch.logical_not(self._is_layer)
        self._all = torch.ones(n, dtype=torch.bool, device=device)
        self._false = torch.zeros(n, dtype=torch.bool, device=device)
        self._nan = torch.full((n,), torch.nan, device=device)
        # per step: norm, running scale, half-width of the spike band (log), for the diagnosis
        self._ring = torch.full((self.rules.history, 3, n), torch.nan, device=device)
        self._ring_steps = [-1] * self.rules.history
        self._mailbox = HostMailbox((_FLOOR + 1, n), device)
        self._cuda = device.type == "cuda"
        self._loss_scale = _RunningScale(1, self.rules, device)
        # The loss report is also diverging's state (its last four entries, updated in place):
        # one buffer, posted as is, so a quiet step is a few fused scalar kernels.
        self._loss_report = torch.zeros(_L_FIRST + 1, device=device)
        self._loss_report[_L_SCALE] = math.nan
        self._loss_state = self._loss_report[_L_MEAN:]
        self._loss_views = self._loss_report.unbind(0)
        self._loss_seen = 0  # finite losses in the state, counted on the host from the reports
        self._loss_box = HostMailbox((_L_FIRST + 1,), device)
        self._stall = torch.full((_S_LEVEL + 1,), torch.nan, device=device)
        self._stall_box = HostMailbox((_S_LEVEL + 1,), device)
        self._peak_lr = 0.0
        self.evaluated = 0
        """Optimizer steps the rules were evaluated on, since construction."""
        self.total = 0
        """Alarms since construction (every rule, transient spikes included)."""
        self.counts: dict[str, int] = dict.fromkeys(ALARM_RULES, 0)
        """Flagged (layer, step) pairs per rule since :meth:`take_epoch`, on the host."""
        self.log: list[GradientAlarm] = []
        """Every alarm since :meth:`take_epoch`, one per rule and step."""
        self._new: list[GradientAlarm] = []

    @torch.no_grad()
    def update(
        self,
        norm: torch.Tensor,
        rows: torch.Tensor | None = None,
        *,
        step: int,
        amp: bool = False,
        order: Sequence[int] = (),
        weights: WeightNorms | None = None,
        stepped: torch.Tensor | None = None,
        clip: float | None = None,
    ) -> None:
        """Apply the rules to one optimizer step (no host sync) and post the verdict.

        Args:
            norm: ``[len(rows)]`` gradient L2 norms, last the global one; a ``[len(rows), k]``
                table is read in its first column.
            rows: the rows ``norm`` covers (the layers one optimizer steps, then global; default:
                all). When they are not every layer, the global row is left out of the rules.
            step: the optimizer step, for the messages.
            amp: a GradScaler is active: non-finite gradients are an overflow it skips.
            order: layer rows in the order their output-gradient hooks fired.
            weights: gives the weight norms of ``rows`` when a rule fired (the attribution
                pass); ``None``: the non-finite alarm goes by gradients only.
            stepped: ``[len(rows)]`` bool, false for a layer none of whose parameters got a
                gradient this step (a branch not taken): left out of the rules (default: all).
            clip: the largest global L2 norm the optimizer will apply (gradients clipped by norm
                between this call and the step; a bound under clipping by value); ``None``: not
                clipped. *explosion* judges the gradient as clipped.
        """
        self._drain(wait=True)  # the previous step's verdict: at most one step late
        self.evaluated += 1
        norm = norm[:, 0] if norm.dim() == 2 else norm
        norm, active = self._rows_of(norm.float(), rows, stepped)
        report = self._evaluate(norm, active, amp, clip)
        slot = step % self.rules.history
        self._ring[slot].copy_(report[_NORM : _BAND + 1])
        self._ring_steps[slot] = step
        self._mailbox.post(report, (step, tuple(dict.fromkeys(order)), rows, weights, clip))
        if not self._cuda:  # the copy was the read: diagnose now, while the weights are these
            self._drain(wait=False)

    def _rows_of(
        self, norm: torch.Tensor, rows: torch.Tensor | None, stepped: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Norms of every row (NaN where not stepped) and which rows were stepped."""
        n = len(self.layers)
        if rows is None or rows.numel() == n:  # one optimizer stepping every layer: no scatter
            return norm, self._all if stepped is None else stepped
        full = norm.new_full((n,), torch.nan).index_copy_(0, rows, norm)
        # The global row of a subset (a GAN's generator, say) is not comparable from step to
        # step with another optimizer's: it stays out of the rules, its layers do not.
        active = torch.zeros_like(self._all).index_fill_(0, rows[:-1], True)
        if stepped is not None:
            active.index_copy_(0, rows[:-1], stepped[:-1])
        return full, active

    def _evaluate(
        self, norm: torch.Tensor, active: torch.Tensor, amp: bool, clip: float | None
    ) -> torch.Tensor:
        """``[flags of each rule..., norm, scale, band, floor]`` x rows; the state updated.

        Python-side branches keep the usual step (every row stepped, no AMP, default rules) to
        about 50 small kernels.
        """
        rules, no = self.rules, self._false
        log_norm = norm.log()
        finite = torch.lt(log_norm.abs(), math.inf)  # a positive, finite norm
        bad = torch.lt(norm.abs(), math.inf)
        bad = bad.logical_not_() if active is self._all else torch.logical_and(active, ~bad)
        overflow = bad.any() if amp else None
        ok = active if overflow is None else active & ~overflow
        ceiling, armed = self._scale.threshold(rules.spike_factor or math.inf)
        scale = torch.where(armed, self._scale.mean.exp(), self._nan)
        band = torch.sub(ceiling, self._scale.mean)
        spike = no
        if rules.spike_factor is not None:
            spike = torch.gt(log_norm, ceiling).logical_and_(finite)
            spike = spike if ok is self._all else spike.logical_and_(ok)
        explosion = self._explosion(log_norm, clip, finite if ok is self._all else finite & ok)
        absolute = no
        if rules.max_grad_norm is not None:
            absolute = (norm > rules.max_grad_norm).logical_and_(ok).logical_and_(~self._is_layer)
        layers = self._is_layer if ok is self._all else torch.logical_and(ok, self._is_layer)
        vanishing, floor = self._vanishing(norm, layers, finite)
        nonfinite = no
        if rules.nonfinite:
            nonfinite = torch.logical_and(bad, self._is_layer)
            nonfinite = nonfinite if overflow is None else nonfinite.logical_and_(~overflow)
        amp_flag = no if overflow is None else overflow & ~self._is_layer
        keep = finite if ok is self._all else torch.logical_and(finite, ok)
        self._scale.update(log_norm, keep, ceiling)
        flags = torch.stack([spike, explosion, absolute, vanishing, nonfinite, amp_flag]).float()
        return torch.cat([flags, torch.stack([norm, scale, band, floor])])

    def _explosion(
        self, log_norm: torch.Tensor, clip: float | None, keep: torch.Tensor
    ) -> torch.Tensor:
        """*explosion*: rows whose gradient as the optimizer applies it (scaled down as the
        global norm is clipped to ``clip``) is above ``explode_factor`` x the running scale, on a
        step whose global row is too (or is out of the rules: a subset's optimizer). A bad
        batch or a numerical fault blows up the whole gradient; one layer's norm alone jumps in
        healthy runs (an embedding meeting rare tokens), and per coordinate it is no outlier."""
        if self.rules.explode_factor is None:
            return self._false
        ceiling, _ = self._scale.threshold(self.rules.explode_factor)
        if clip is not None:  # every row scales by min(1, clip / global norm)
            shrink = torch.rsub(log_norm[-1:], math.log(clip)).clamp_max_(0.0)
            log_norm = torch.add(log_norm, shrink)
        fired = torch.gt(log_norm, ceiling).logical_and_(keep)
        return fired.logical_and_(torch.logical_or(fired[-1:], ~keep[-1:]))

    def _vanishing(
        self, norm: torch.Tensor, layers: torch.Tensor, finite: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Which layers finished a run of ``vanish_steps`` tiny steps, and the floor."""
        fraction = self.rules.vanish_fraction
        if fraction is None:
            return self._false, self._nan
        live = torch.where(torch.logical_and(finite, layers), norm, self._nan)
        # 0 when every layer is zero: a zero norm is always tiny
        floor = torch.nanmedian(live).mul_(fraction).nan_to_num_(0.0)
        tiny = torch.le(norm, floor).logical_and_(layers)
        self._low.mul_(
            torch.logical_or(
                tiny, self._not_layer if layers is self._is_layer else torch.logical_not(layers)
            )
        ).add_(tiny)  # a layer not stepped keeps its count
        return torch.eq(self._low, self.rules.vanish_steps).logical_and_(tiny), floor.expand_as(
            norm
        )

    @torch.no_grad()
    def update_loss(self, loss: torch.Tensor, *, step: int) -> None:
        """Apply the loss rules (*loss_spike*, *diverging*) to one training loss (a device
        scalar; no host sync: the previous step's loss verdict is read, at most one step late).

        A loss that is not finite fires *diverging* and leaves its running mean, best and first
        loss as they were; one that is not positive stays out of *loss_spike*'s (log) scale and
        never fires it.
        """
        if not self.rules.watches_loss:
            return
        self._drain_loss(wait=True)  # also counts the finite losses seen so far
        x = loss if loss.dim() == 0 else loss.reshape(())
        x = x if x.dtype == torch.float32 else x.float()
        if self.rules.loss_factor is not None:
            self._loss_spike(x)
        margin = self._loss_views[_L_DIVERGING]
        if self.rules.diverge_ratio is None:
            pass
        elif self._loss_seen == 0:
            self._diverge_start(x, margin)
        else:
            self._diverge_step(x, margin)
        self._loss_views[_L_VALUE].copy_(x)
        self._loss_box.post(self._loss_report, step)
        if not self._cuda:
            self._drain_loss(wait=False)

    @torch.no_grad()
    def update_stall(self, update: torch.Tensor, lr: float, *, step: int) -> None:
        """*stall*, on a logging step: ``update`` (the typical size of a weight's change this
        step, a device scalar: :func:`~.grad_stats.typical_update`) per unit
        of the learning rate ``lr`` against its running level (a few kernels, no host sync: the
        verdict is read at the next poll).

        Not evaluated while ``lr`` is under 1% of its peak so far (a schedule decaying it to
        zero moves the weights less than float32 resolves).
        """
        if self.rules.stall_factor is None or not lr > 0.0:
            return
        self._peak_lr = max(self._peak_lr, float(lr))
        if lr < _STALL_LR_FLOOR * self._peak_lr:
            return
        self._drain_stall(wait=True)
        flag, value, before, level = self._stall.unbind(0)
        torch.div(update.detach().reshape(()).float(), lr, out=value).log_()
        before.copy_(level)
        low = torch.sub(level, math.log(self.rules.stall_factor))
        finite = torch.lt(value.abs(), math.inf)
        # False while the level is NaN (the first logging step), and on a zero update (-inf):
        # a weight that does not move at all is a dead unit or a frozen tensor, not this rule's
        torch.lt(value, low, out=flag).logical_and_(finite)
        # a collapse folds in clamped (as the spike rule's scale), so it keeps firing a while
        target = torch.where(finite, torch.maximum(value, low), level)
        start = torch.logical_and(level.isnan(), finite)
        level.lerp_(target, _STALL_ALPHA).copy_(torch.where(start, value, level))
        self._stall_box.post(self._stall, step)
        if not self._cuda:
            self._drain_stall(wait=False)

    def _drain_stall(self, wait: bool) -> None:
        got = self._stall_box.read(wait)
        if got is None or not got[0][_S_FLAG] > 0:
            return
        report, step = got
        value, level = math.exp(report[_S_VALUE]), math.exp(report[_S_BEFORE])
        text = (
            f"learning stalled at optimizer step {step}: the typical update per unit of "
            f"learning rate (median |w_after - w_before| / lr) is {value:.4g}, "
            f"{level / value:.3g}x below its running level {level:.4g} (stall_factor="
            f"{self.rules.stall_factor}): the optimizer barely moves the weights while the "
            "learning rate says it should"
        )
        self._record(GradientAlarm("stall", "global", step, value, level, text))

    def _diverge_start(self, x: torch.Tensor, margin: torch.Tensor) -> None:
        """The first finite loss starts the state (running mean, best and first loss)."""
        finite = torch.lt(x.abs(), math.inf)
        torch.where(finite, x, self._loss_state, out=self._loss_state)
        self._loss_views[_L_DEV].zero_()
        margin.fill_(-1.0).add_(x, alpha=0.0)  # quiet, or NaN if the loss is not finite

    def _diverge_step(self, x: torch.Tensor, margin: torch.Tensor) -> None:
        """*diverging*'s state updated in place and its margin (``>= 0`` or NaN: it fires):
        ``min(rise - noise_bar - (ratio - 1) |best|, rise - giveback * learnt)``."""
        rules = self.rules
        assert rules.diverge_ratio is not None
        mean, dev, best, first = self._loss_views[_L_MEAN:]
        # a non-finite loss moves nothing (its deviation counts as 0) and fires through margin
        delta = torch.sub(x, mean).nan_to_num_(0.0, 0.0, 0.0)
        mean.add_(delta, alpha=2.0 / (rules.diverge_span + 1))
        torch.minimum(best, mean, out=best)
        rise = torch.sub(mean, best)
        learnt = torch.sub(first, best)  # >= 0: the best never rises above the first loss
        noise = torch.sub(dev, learnt, alpha=1.0 / _LEARNT_NOISE).clamp_min_(0.0)
        ratio = torch.sub(rise, noise, alpha=rules.diverge_noise).sub_(
            best.abs(), alpha=rules.diverge_ratio - 1.0
        )
        giveback = torch.sub(rise, learnt, alpha=rules.diverge_giveback)
        torch.minimum(ratio, giveback, out=margin).add_(x, alpha=0.0)
        # the deviation after the check: a blow-up's own step does not raise its bar
        weight = max(2.0 / (2 * rules.diverge_span + 1), 1.0 / self._loss_seen)
        dev.lerp_(delta.abs_(), weight)

    def _loss_spike(self, x: torch.Tensor) -> None:
        """*loss_spike*'s flag and running scale into the report (the scale updated)."""
        assert self.rules.loss_factor is not None
        log_loss = x.log()
        ceiling, _ = self._loss_scale.threshold(self.rules.loss_factor)
        positive = log_loss.abs() < math.inf
        self._loss_report[_L_SPIKE : _L_SPIKE + 1].copy_(positive & (log_loss > ceiling))
        self._loss_report[_L_SCALE : _L_SCALE + 1].copy_(self._loss_scale.mean.exp())
        self._loss_scale.update(log_loss, positive, ceiling)

    @property
    def spike_score(self) -> float:
        """Alarms per 1,000 evaluated optimizer steps since construction (every rule; one-step
        transient spikes included), as OLMo-core's ``SpikeScore``: compare runs at a glance."""
        return 1000.0 * self.total / max(self.evaluated, 1)

    def poll(self, wait: bool = False) -> list[GradientAlarm]:
        """Alarms read on the host since the last poll (``wait``: include the latest step)."""
        self._drain(wait)
        new, self._new = self._new, []
        return new

    def _drain_loss(self, wait: bool) -> None:
        got = self._loss_box.read(wait)
        if got is None:
            return
        report, step = got
        self._loss_seen += bool(np.isfinite(report[_L_VALUE]))
        if not (report[_L_SPIKE] > 0 or _fires(report, self.rules)):
            return
        report = report.copy()
        history = self._history(step)
        for alarm in _loss_alarms(step, report, self.rules):
            self._record(_with_history(alarm, self.layers, history))

    def _drain(self, wait: bool) -> None:
        self._drain_loss(wait)
        self._drain_stall(wait)
        got = self._mailbox.read(wait)
        if got is None:
            return
        report, (step, order, rows, weights, clip) = got
        flags = report[:_GRAD_RULES]
        if not flags.any():
            return
        report = report.copy()  # the view is overwritten by the next post
        weight = _weight_norms(weights, rows, len(self.layers)) if flags[_NONFINITE].any() else None
        history = self._history(step)
        for index in np.flatnonzero(flags.any(axis=1)):
            hit = np.flatnonzero(flags[index])
            alarm = self._alarm(int(index), hit, report, weight, step, order, clip)
            self._record(_with_history(alarm, self.layers, history))

    def _record(self, alarm: GradientAlarm) -> None:
        self.counts[alarm.rule] += 1 + len(alarm.others)
        self.total += 1
        self.log.append(alarm)
        self._new.append(alarm)

    def _history(self, step: int) -> tuple[list[int], np.ndarray]:
        """The ring buffer up to ``step``, oldest first, on the host (a sync: an alarm fired)."""
        ring = self._ring.cpu().numpy()
        slots = sorted(
            (s, i)
            for i, s in enumerate(self._ring_steps)
            if 0 <= s <= step and step - s < len(ring)
        )
        return [s for s, _ in slots], ring[[i for _, i in slots]]

    def _alarm(
        self,
        index: int,
        hit: np.ndarray,
        report: np.ndarray,
        weight: np.ndarray | None,
        step: int,
        order: tuple[int, ...],
        clip: float | None,
    ) -> GradientAlarm:
        norm = report[_NORM]
        ref = {
            _SPIKE: report[_SCALE],
            _EXPLOSION: report[_SCALE],
            _ABSOLUTE: np.full_like(norm, self.rules.max_grad_norm or math.nan),
            _VANISHING: report[_FLOOR],
        }.get(index, weight if weight is not None else np.full_like(norm, -1.0))
        row = int(_culprit(index, hit, norm, ref, order, len(self.layers) - 1))
        layer, value, reference = self.layers[row], float(norm[row]), float(ref[row])
        others = tuple(self.layers[i] for i in hit if i != row)
        if index == _EXPLOSION:
            text = _explosion_text(layer, step, value, reference, report, clip, self.rules)
        else:
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
        """Running scales, vanishing counters, ring buffer and counts, on the host."""
        self._drain(wait=True)
        return {
            "layers": self.layers,
            "scale": self._scale.state.cpu(),
            "loss_scale": self._loss_scale.state.cpu(),
            "diverging": self._loss_state.cpu(),
            "loss_seen": self._loss_seen,
            "stall": self._stall.cpu(),
            "peak_lr": self._peak_lr,
            "low": self._low.cpu(),
            "ring": self._ring.cpu(),
            "ring_steps": list(self._ring_steps),
            "counts": dict(self.counts),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the layers must match this instance's."""
        if tuple(state["layers"]) != self.layers:
            raise ValueError(
                f"GradientAlarms.load_state_dict: saved layers {tuple(state['layers'])!r} differ "
                f"from this model's {self.layers!r}"
            )
        if "scale" not in state:
            raise ValueError("GradientAlarms.load_state_dict: a state of an older version")
        self._scale.state.copy_(state["scale"])
        self._loss_scale.state.copy_(state["loss_scale"])
        if "diverging" in state:  # an older state's loss rule starts again
            self._loss_state.copy_(state["diverging"])
            self._loss_seen = int(state["loss_seen"])
        if "stall" in state:  # an older state's stall level starts again
            self._stall.copy_(state["stall"])
            self._peak_lr = float(state["peak_lr"])
        self._low.copy_(state["low"])
        if state["ring"].shape == self._ring.shape:
            self._ring.copy_(state["ring"])
            self._ring_steps = list(state["ring_steps"])
        self.counts = {**dict.fromkeys(ALARM_RULES, 0), **state["counts"]}


def _weight_norms(weights: WeightNorms | None, rows: torch.Tensor | None, n: int) -> np.ndarray:
    """The attribution pass: per-row weight norms on the host (-1 where not read)."""
    out = np.full(n, -1.0)
    if weights is not None:
        values = weights().detach().float().cpu().numpy()
        out[rows.cpu().numpy() if rows is not None else np.arange(n)] = values
    return out


def _culprit(
    index: int, hit: np.ndarray, norm: np.ndarray, ref: np.ndarray, order: Sequence[int], last: int
) -> int:
    """The row an alarm names among the flagged rows ``hit`` (``last`` is the global row)."""
    if index == _NONFINITE:
        # ref: weight norms, -1 where not read (no attribution pass, or not stepped)
        broken = [i for i in range(last) if not math.isfinite(ref[i])]
        return broken[0] if broken else _first_backward({int(i) for i in hit}, order, last)
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


def _with_history(
    alarm: GradientAlarm, layers: tuple[str, ...], history: tuple[list[int], np.ndarray]
) -> GradientAlarm:
    steps, ring = history
    advice = f"advice: {_ADVICE[alarm.rule]}" if alarm.rule in _ADVICE else ""
    if not steps:
        return replace(alarm, message=f"{alarm.message}; {advice}") if advice else alarm
    norms, scales = ring[:, 0], ring[:, 1]
    first = _first_departure(norms, scales, ring[:, 2])
    departure = ""
    if first is not None:
        at, row = first
        ratio = norms[at, row] / scales[at, row]
        departure = f"{layers[row]} left its scale first, at step {steps[at]} ({_ratio(ratio)})"
        if advice and alarm.rule != "vanishing":
            advice += f"; look at {layers[row]} first"
    message = "; ".join(part for part in (alarm.message, departure, advice) if part)
    return GradientAlarm(
        **{
            **alarm.__dict__,
            "message": message,
            "history_steps": tuple(steps),
            "history_layers": layers,
            "history": tuple(tuple(float(v) for v in row) for row in norms),
            "history_scale": tuple(tuple(float(v) for v in row) for row in scales),
            "departure": departure,
            "departed": layers[first[1]] if first is not None else "",
        }
    )


def _first_departure(
    norms: np.ndarray, scales: np.ndarray, band: np.ndarray
) -> tuple[int, int] | None:
    """``(step index, layer row)`` where a layer first left its running scale by more than the
    spike rule's band, up or down (or went non-finite), the largest departure of that step (in
    bands); else ``None``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        size = np.abs(np.log(np.abs(norms / scales)))
    size[np.isnan(norms) | np.isnan(scales)] = np.nan  # not stepped, or not armed yet
    size[~np.isnan(scales) & ~np.isfinite(norms)] = np.inf  # a NaN/Inf gradient left for sure
    size /= band
    size[:, -1] = np.nan  # a layer, not the global row
    away = np.nan_to_num(size, nan=0.0) > 1.0
    if not away.any():
        return None
    at = int(np.flatnonzero(away.any(axis=1))[0])
    return at, int(np.nanargmax(np.where(away[at], size[at], -1.0)))


def _ratio(value: float) -> str:
    return f"{value:.3g}x" if math.isfinite(value) else f"{value}"


def _loss_alarms(step: int, report: np.ndarray, rules: AlarmRules) -> list[GradientAlarm]:
    value = float(report[_L_VALUE])
    alarms = []
    if report[_L_SPIKE] > 0:
        ref = float(report[_L_SCALE])
        text = (
            f"loss spike at optimizer step {step}: loss {value:.4g} is {value / ref:.3g}x its "
            f"running scale {ref:.4g} (loss_factor={rules.loss_factor}, "
            f"spike_sigmas={rules.spike_sigmas})"
        )
        alarms.append(GradientAlarm("loss_spike", "loss", step, value, ref, text))
    if _fires(report, rules):
        alarms.append(_diverging(step, value, report, rules))
    return alarms


def _fires(report: np.ndarray, rules: AlarmRules) -> bool:
    """Whether *diverging* fired: its margin is not below 0 (NaN: a non-finite loss)."""
    return rules.diverge_ratio is not None and not report[_L_DIVERGING] < 0


def _diverging(step: int, value: float, report: np.ndarray, rules: AlarmRules) -> GradientAlarm:
    mean, best, first = (float(report[i]) for i in (_L_MEAN, _L_BEST, _L_FIRST))
    if not math.isfinite(value):
        text = f"loss diverging at optimizer step {step}: the loss is {value}"
        return GradientAlarm("diverging", "loss", step, value, best, text)
    learnt = first - best
    given = f"{(mean - best) / learnt:.0%}" if learnt > 0 else "all"
    text = (
        f"loss diverging at optimizer step {step}: its running mean {mean:.4g} (loss "
        f"{value:.4g}) is {_ratio(mean / best) if best > 0 else f'+{mean - best:.4g} over'} "
        f"its best {best:.4g} and has given back {given} of what it had learnt since the first "
        f"step's {first:.4g}, beyond the loss's own swings (mean absolute deviation "
        f"{float(report[_L_DEV]):.3g}) (diverge_ratio={rules.diverge_ratio}, "
        f"diverge_giveback={rules.diverge_giveback}, diverge_noise={rules.diverge_noise}, "
        f"diverge_span={rules.diverge_span})"
    )
    return GradientAlarm("diverging", "loss", step, value, best, text)


def _describe(rule: str, layer: str, step: int, value: float, ref: float, rules: AlarmRules) -> str:
    at = f"optimizer step {step}"
    if rule == "spike":
        return (
            f"gradient spike at {at}: {layer} grad norm {value:.4g} is {value / ref:.3g}x its "
            f"running scale {ref:.4g} (spike_factor={rules.spike_factor}, "
            f"spike_sigmas={rules.spike_sigmas})"
        )
    if rule == "absolute":
        return f"gradient norm above max_grad_norm at {at}: {layer} {value:.4g} > {ref:.4g}"
    if rule == "vanishing":
        return (
            f"vanishing gradient at {at}: {layer} grad norm {value:.4g} is zero or below "
            f"{ref:.4g} (vanish_fraction={rules.vanish_fraction} of the median non-zero layer "
            f"norm) for {rules.vanish_steps} consecutive steps"
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


def _explosion_text(
    layer: str,
    step: int,
    value: float,
    ref: float,
    report: np.ndarray,
    clip: float | None,
    rules: AlarmRules,
) -> str:
    """*explosion*'s message: the size, what the optimizer applies, and advice with a clip
    value read from the global row's running scale."""
    global_norm, global_scale = float(report[_NORM, -1]), float(report[_SCALE, -1])
    shrink = 1.0 if clip is None or global_norm <= clip else clip / global_norm
    applied = (
        "reaches the optimizer unclipped"
        if shrink == 1.0
        else f"is still {value * shrink / ref:.3g}x its scale after clipping to {clip:.4g}"
    )
    suggested = f"{5.0 * global_scale:.2g}" if math.isfinite(global_scale) else "a few times it"
    return (
        f"gradient explosion at optimizer step {step}: {layer} grad norm {value:.4g} is "
        f"{value / ref:.3g}x its running scale {ref:.4g} and {applied} (explode_factor="
        f"{rules.explode_factor}): one such step wrecks SGD's weights or poisons an adaptive "
        f"optimizer's second moment for thousands of steps; advice: clip gradients at a few "
        f"times the global norm's running scale {global_scale:.3g} (gradient_clip_val="
        f"{suggested}), or skip such steps with on_alarm={{'spike': 'skip'}}"
    )
