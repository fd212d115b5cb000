"""What an alarm says, built on the host once a rule fired: :class:`TrainingAlarm`, the layer it
names, its message, the ring buffer's story and the rule's advice."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import NamedTuple

import numpy as np

from lightning_hooks.core.alarms.gradients import GradientReport
from lightning_hooks.core.alarms.rules import AlarmRules, WeightNorms
from lightning_hooks.core.checks import named_arguments

__all__ = [
    "FiredStep",
    "NormHistory",
    "TrainingAlarm",
    "gradient_alarm",
    "ratio_text",
    "weight_norms",
    "with_history",
]

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
    "attention": "qk-layernorm (a LayerNorm on each head's queries and keys before their dot "
    "product), a lower learning rate, or a cap on the attention logits (cap * tanh(logit / "
    "cap), as Gemma 2 does)",
}


@named_arguments
@dataclass(frozen=True)
class TrainingAlarm:
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
        history: per step, the gradient norm of every row (``history_layers``: the layers, then
            ``"global"``); ``history_scale``: their running scales (NaN: not armed yet).
        departure: which layer left its running scale first (beyond the spike band), when, and
            by how much; ``departed``: its name (``""``: none did in the ring buffer).
        counts: whether it adds to its rule's count; ``False`` for a line that only closes
            what an earlier alarm opened (a setback that recovered).
    """

    rule: str
    layer: str
    step: int
    value: float
    reference: float
    message: str
    others: tuple[str, ...] = ()
    history_steps: tuple[int, ...] = ()
    history: tuple[tuple[float, ...], ...] = ()
    history_scale: tuple[tuple[float, ...], ...] = ()
    history_layers: tuple[str, ...] = ()
    departure: str = ""
    departed: str = ""
    counts: bool = True

    def history_lines(self) -> list[str]:
        """Step by step, norm / running scale of the layer that left first, the layer named and
        the global row (``"-"``: not armed yet)."""
        names = dict.fromkeys(n for n in (self.departed, self.layer, "global") if n)
        rows = [self.history_layers.index(n) for n in names if n in self.history_layers]

        def cell(row: int, norm: float, scale: float) -> str:
            ratio = ratio_text(norm / scale) if math.isfinite(scale) and scale > 0 else "-"
            return f"{self.history_layers[row]} {norm:.4g} ({ratio})"

        history = zip(self.history_steps, self.history, self.history_scale, strict=True)
        return [
            f"step {step}: " + ", ".join(cell(r, norm[r], scale[r]) for r in rows)
            for step, norm, scale in history
        ]


class FiredStep(NamedTuple):
    """The optimizer step a gradient rule fired at, as its messages tell it."""

    step: int
    """The optimizer step (0-based)."""
    order: tuple[int, ...]
    """Layer rows in the order their output-gradient hooks fired (empty: not known)."""
    clip: float | None
    """The largest global L2 norm the optimizer applies (``None``: no clip)."""
    weight_norms: np.ndarray | None
    """Per row, the weight norm (-1 where not read), when *nonfinite* fired; else ``None``."""


class NormHistory(NamedTuple):
    """The ring buffer's last steps up to an alarm's, oldest first: what an alarm reports."""

    steps: list[int]
    """The optimizer steps."""
    traced: np.ndarray
    """``[steps, 3, rows]``: per step, a report's norm, running scale and spike band."""

    @property
    def norms(self) -> np.ndarray:
        """``[steps, rows]`` gradient norms."""
        norms: np.ndarray = self.traced[:, 0]
        return norms

    @property
    def scales(self) -> np.ndarray:
        """``[steps, rows]`` running scales (NaN: not armed yet)."""
        scales: np.ndarray = self.traced[:, 1]
        return scales

    @property
    def bands(self) -> np.ndarray:
        """``[steps, rows]`` half-widths of the spike band, in log."""
        bands: np.ndarray = self.traced[:, 2]
        return bands


class _Culprit(NamedTuple):
    """The row an alarm names: its layer, its value and what that was compared with."""

    layer: str
    value: float
    reference: float


def gradient_alarm(
    rule: str, report: GradientReport, at: FiredStep, layers: tuple[str, ...], rules: AlarmRules
) -> TrainingAlarm:
    """The alarm of the gradient ``rule`` (one of ``GRADIENT_RULES``) at the rows it flagged in
    ``report`` (the rows of ``layers``), at the step ``at``."""
    hit = np.flatnonzero(report.fired(rule))
    norm = report.norm
    ref = {
        "spike": report.scale,
        "explosion": report.scale,
        "absolute": np.full_like(norm, rules.max_grad_norm or math.nan),
        "vanishing": report.floor,
    }.get(rule, at.weight_norms if at.weight_norms is not None else np.full_like(norm, -1.0))
    row = int(_culprit(rule, hit, norm, ref, at.order))
    culprit = _Culprit(layers[row], float(norm[row]), float(ref[row]))
    others = tuple(layers[i] for i in hit if i != row)
    if rule == "explosion":
        text = _explosion_text(culprit, report, at, rules)
    else:
        text = _describe(rule, culprit, at.step, rules)
    if others:
        text += f" (also flagged: {', '.join(others)})"
    layer, value, reference = culprit
    return TrainingAlarm(rule, layer, at.step, value, reference, text, others)


def weight_norms(weights: WeightNorms | None, rows: np.ndarray | None, n: int) -> np.ndarray:
    """The attribution pass: per-row weight norms on the host (-1 where not read)."""
    out = np.full(n, -1.0)
    if weights is not None:
        values = weights().detach().float().cpu().numpy()
        out[rows if rows is not None else np.arange(n)] = values
    return out


def _culprit(
    rule: str, hit: np.ndarray, norm: np.ndarray, ref: np.ndarray, order: Sequence[int]
) -> int:
    """The row an alarm names among the flagged rows ``hit`` (the last row is the global)."""
    last = norm.size - 1
    if rule == "nonfinite":
        # ref: weight norms, -1 where not read (no attribution pass, or not stepped)
        broken = [i for i in range(last) if not math.isfinite(ref[i])]
        if broken:
            return broken[0]
        # the first flagged row in backward order: hook order, then reverse model order
        flagged = {int(i) for i in hit}
        return next(row for row in chain(order, range(last - 1, -1, -1)) if row in flagged)
    layers = hit[hit != last]
    if layers.size == 0:
        return last
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = norm[layers] / ref[layers]
    if not np.isfinite(ratio).any():
        return int(layers[0])
    return int(layers[(np.nanargmin if rule == "vanishing" else np.nanargmax)(ratio)])


def with_history(
    alarm: TrainingAlarm, layers: tuple[str, ...], history: NormHistory
) -> TrainingAlarm:
    """``alarm`` with the ring buffer's ``history`` (its steps, and per step the rows' norms,
    running scales and bands), the layer that left its scale first, and the rule's advice."""
    steps = history.steps
    advice = f"advice: {_ADVICE[alarm.rule]}" if alarm.rule in _ADVICE else ""
    if not steps:
        return replace(alarm, message=f"{alarm.message}; {advice}") if advice else alarm
    norms = history.norms
    scales = history.scales
    first = _first_departure(norms, scales, history.bands)
    departure = ""
    if first is not None:
        at = first.at
        row = first.row
        ratio = norms[at, row] / scales[at, row]
        departure = f"{layers[row]} left its scale first, at step {steps[at]} ({ratio_text(ratio)})"
        if advice and alarm.rule != "vanishing":
            advice += f"; look at {layers[row]} first"
    return replace(
        alarm,
        message="; ".join(part for part in (alarm.message, departure, advice) if part),
        history_steps=tuple(steps),
        history_layers=layers,
        history=tuple(map(tuple, norms.tolist())),
        history_scale=tuple(map(tuple, scales.tolist())),
        departure=departure,
        departed=layers[first.row] if first is not None else "",
    )


class _Departure(NamedTuple):
    """Where a layer first left its running scale, in a :class:`NormHistory`."""

    at: int
    """The index of the step in the history."""
    row: int
    """The layer's row."""


def _first_departure(norms: np.ndarray, scales: np.ndarray, band: np.ndarray) -> _Departure | None:
    """The largest departure beyond the spike band (or to a non-finite norm) at the first step
    a layer left its running scale; else ``None``."""
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
    return _Departure(at, int(np.nanargmax(np.where(away[at], size[at], -1.0))))


def ratio_text(value: float) -> str:
    """``value`` as a ratio: ``3.2x``."""
    return f"{value:.3g}x" if math.isfinite(value) else f"{value}"


def _describe(rule: str, culprit: _Culprit, step: int, rules: AlarmRules) -> str:
    """The message of a gradient rule other than *explosion*."""
    layer, value, ref = culprit
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
        what, order = ("weights", "forward") if not math.isfinite(ref) else ("gradient", "backward")
        return (
            f"non-finite {what} at {at}: {layer} (first layer in {order} order), "
            f"grad norm {value:.4g}"
        )
    return f"AMP overflow at {at}, step skipped by the GradScaler (grad norm {value:.4g})"


def _explosion_text(
    culprit: _Culprit, report: GradientReport, at: FiredStep, rules: AlarmRules
) -> str:
    """*explosion*'s message: the size, what the optimizer applies, and advice with a clip
    value read from the global row's running scale."""
    layer, value, ref = culprit
    step = at.step
    clip = at.clip
    global_norm = float(report.norm[-1])
    global_scale = float(report.scale[-1])
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
