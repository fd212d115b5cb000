"""What an alarm says, built on the host once a rule fired.

:class:`TrainingAlarm`, the layer it names, its message (a first line a person reads at a
glance, then the details, one per line), the ring buffer's history, and the fixes :mod:`.advice`
gives it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import NamedTuple

import numpy as np

from lightning_hooks.core.alarms.advice import Advice
from lightning_hooks.core.alarms.gradients import DEAD_STEPS, GradientReport
from lightning_hooks.core.alarms.rules import AlarmRules, WeightNorms
from lightning_hooks.core.checks import named_arguments

__all__ = [
    "FiredStep",
    "Message",
    "NormHistory",
    "TrainingAlarm",
    "gradient_alarm",
    "ratio_text",
    "weight_norms",
    "with_dead_network_story",
    "with_fixes",
    "with_history",
]


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
        message: the whole text: a first line a person reads at a glance (what happened, at
            which step, and the fix most likely to work), then :attr:`details`, one per line.
        others: the other layers the rule flagged at the same step.
        history_steps: the optimizer steps in the ring buffer, oldest first, up to ``step``.
        history: per step, the gradient norm of every row (``history_layers``: the layers, then
            ``"global"``); ``history_scale``: their running scales (NaN: not armed yet).
        departure: which layer left its running scale first (beyond the spike band), when, and
            by how much; ``departed``: its name (``""``: none did in the ring buffer).
        counts: whether it adds to its rule's count; ``False`` for a line that only closes
            what an earlier alarm opened (a setback that recovered).
        network_cut: a *vanishing* of a dead network: the layer and every layer before it get
            exactly zero gradient (:data:`~.gradients.DEAD_STEPS`).
        details: the lines after the first: the thresholds, the evidence, the other layers,
            the layer that left its scale first, the other fixes.
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
    details: tuple[str, ...] = ()
    network_cut: bool = False

    def history_lines(self) -> list[str]:
        """Return the ring buffer's history, step by step.

        Returns:
            One line per step: the norm / running scale of the layer that left first, the layer
            named and the global row (``"-"``: not armed yet).
        """
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
    """Write the alarm of a gradient rule at the rows it flagged.

    Args:
        rule: the rule that fired, one of ``GRADIENT_RULES``.
        report: the gradient report whose rows the rule flagged, with their norms and
            references.
        at: the optimizer step it fired at, as the messages tell it.
        layers: the name of each row of ``report``.
        rules: the alarm rules, whose thresholds the message quotes.

    Returns:
        The alarm, naming the row most out of line (its first line and its details).
    """
    hit = np.flatnonzero(report.fired(rule))
    norm = report.norm
    ref = {
        "spike": report.scale,
        "explosion": report.scale,
        "absolute": np.full_like(norm, rules.max_grad_norm or math.nan),
        "vanishing": report.floor,
        "no_gradient": report.floor,
    }.get(rule, at.weight_norms if at.weight_norms is not None else np.full_like(norm, -1.0))
    row = int(_culprit(rule, hit, norm, ref, at.order))
    culprit = _Culprit(layers[row], float(norm[row]), float(ref[row]))
    others = tuple(layers[i] for i in hit if i != row)
    # a dead network: this layer and every stepped one before it get exactly zero gradient
    before = norm[:row][~np.isnan(norm[:row])]
    cut = rule == "vanishing" and culprit.value == 0 and not before.any()
    if rule == "explosion":
        said = _explosion_text(culprit, report, at, rules)
    elif cut:
        said = _dead_network_text(culprit, at.step)
    else:
        said = _describe(rule, culprit, at.step, rules)
    details = list(said.details)
    if others:
        details.append(f"also flagged: {', '.join(others)}")
    layer, value, reference = culprit
    return TrainingAlarm(
        rule,
        layer,
        at.step,
        value,
        reference,
        said.first,
        others,
        details=tuple(details),
        network_cut=cut,
    )


def weight_norms(weights: WeightNorms | None, rows: np.ndarray | None, n: int) -> np.ndarray:
    """Read per-row weight norms on the host: the attribution pass.

    Args:
        weights: returns the weight norms on the device (``None``: none are read).
        rows: the rows the norms are of (``None``: every row, in order).
        n: the number of rows.

    Returns:
        ``[n]`` weight norms, -1 where not read.
    """
    out = np.full(n, -1.0)
    if weights is not None:
        values = weights().detach().float().cpu().numpy()
        out[rows if rows is not None else np.arange(n)] = values
    return out


def _culprit(
    rule: str, hit: np.ndarray, norm: np.ndarray, ref: np.ndarray, order: Sequence[int]
) -> int:
    """Return the row an alarm names among the flagged rows ``hit`` (the last is the global)."""
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
    """Add the ring buffer's history to ``alarm``.

    Args:
        alarm: the alarm to add the history to.
        layers: the name of each row of the history.
        history: the ring buffer's steps, and per step the rows' norms, running scales and
            bands.

    Returns:
        The alarm with the history, and the layer that left its scale first as a line of its
        details (``alarm`` itself where the history is empty).
    """
    steps = history.steps
    if not steps:
        return alarm
    norms = history.norms
    scales = history.scales
    first = _first_departure(norms, scales, history.bands)
    departure = ""
    if first is not None:
        at = first.at
        row = first.row
        ratio = norms[at, row] / scales[at, row]
        departure = f"{layers[row]} left its scale first, at step {steps[at]} ({ratio_text(ratio)})"
        if alarm.rule not in ("vanishing", "no_gradient"):
            departure += ": look at it first"
    return replace(
        alarm,
        details=(*alarm.details, departure) if departure else alarm.details,
        history_steps=tuple(steps),
        history_layers=layers,
        history=tuple(map(tuple, norms.tolist())),
        history_scale=tuple(map(tuple, scales.tolist())),
        departure=departure,
        departed=layers[first.row] if first is not None else "",
    )


def with_dead_network_story(
    alarm: TrainingAlarm, losses: Sequence[float], jump: str, chance: tuple[int, float] | None
) -> TrainingAlarm:
    """Add what the loss did to a dead network's alarm, as lines of its details.

    The alarm is one of :attr:`TrainingAlarm.network_cut`. The lines tell its mean losses since
    the death began (``losses``), against ``ln C`` where the output layer's ``C`` units are
    known (``chance``: ``(C, ln C)``), and the jump before it (``jump``: its line, ``""`` for
    none).

    Args:
        alarm: the dead network's *vanishing* alarm.
        losses: the mean loss of each optimizer step since the death began (empty: not known).
        jump: the line that tells the loss's jump before the death, or ``""``.
        chance: the output layer's units and the loss of a uniform guess over them, or
            ``None`` where the model's output layer is not known.

    Returns:
        The alarm with those lines after its own details.

    Example:
        >>> alarm = TrainingAlarm("vanishing", "net.2", 14, 0.0, 0.0, "dead network",
        ...                       network_cut=True)
        >>> said = with_dead_network_story(alarm, [2.31, 2.30, 2.30], "", (10, math.log(10)))
        >>> said.details[0].split(", a uniform guess")[0]
        'the loss since step 10: 2.3 to 2.31, at ln 10 = 2.303'
    """
    lines = []
    if losses:
        low = min(losses)
        high = max(losses)
        line = f"the loss since step {alarm.step - DEAD_STEPS + 1}: {low:.3g} to {high:.3g}"
        if chance is not None:
            units, loss = chance
            guess = (
                f"ln {units} = {loss:.4g}, a uniform guess over the output layer's {units} units"
            )
            near = abs(low - loss) <= 0.05 * loss and abs(high - loss) <= 0.05 * loss
            line += f", at {guess}: the network has stopped learning" if near else f" ({guess})"
        lines.append(line)
    if jump:
        lines.append(jump)
    return replace(alarm, details=(*alarm.details, *lines))


def with_fixes(alarm: TrainingAlarm, advice: Advice) -> TrainingAlarm:
    """Write ``alarm``'s whole text, with the ``advice``'s fixes.

    Its first line with the first of the fixes (the one most likely to work,
    :func:`~lightning_hooks.core.alarms.advice.advise`), then the run's learning rate (when a
    fix is to lower it), its details, why that fix leads (when the evidence put it first) and
    the other fixes, one per line.

    Args:
        alarm: the alarm, its first line and details written.
        advice: the fixes for its rule, why the first leads and the run's learning rate.

    Returns:
        The alarm with its whole message, and the added lines among its details.

    Example:
        >>> alarm = TrainingAlarm("absolute", "net.0", 3, 9.0, 5.0, "grad norm 9 > 5",
        ...                       details=("max_grad_norm=5.0",))
        >>> advice = Advice(("clip gradients", "lower the learning rate"))
        >>> print(with_fixes(alarm, advice).message)
        grad norm 9 > 5; fix: clip gradients
        max_grad_norm=5.0
        other fixes: lower the learning rate
    """
    fixes = advice.fixes
    first = alarm.message if not fixes else f"{alarm.message}; fix: {fixes[0]}"
    # the run's learning rate next to the fix, on the first of the lines after it
    rate = (advice.rate,) if advice.rate else ()
    why = (advice.why,) if advice.why else ()
    rest = (f"other fixes: {'; '.join(fixes[1:])}",) if len(fixes) > 1 else ()
    details = (*rate, *alarm.details, *why, *rest)
    return replace(alarm, message="\n".join([first, *details]), details=details)


class _Departure(NamedTuple):
    """Where a layer first left its running scale, in a :class:`NormHistory`."""

    at: int
    """The index of the step in the history."""
    row: int
    """The layer's row."""


def _first_departure(norms: np.ndarray, scales: np.ndarray, band: np.ndarray) -> _Departure | None:
    """Find where a layer first left its running scale.

    Args:
        norms: ``[steps, rows]`` gradient norms.
        scales: ``[steps, rows]`` running scales (NaN: not armed yet).
        band: ``[steps, rows]`` half-widths of the spike band, in log.

    Returns:
        The largest departure beyond the spike band (or to a non-finite norm) at the first step
        a layer left its running scale; else ``None``.
    """
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
    """Write ``value`` as a ratio: ``3.2x``.

    Args:
        value: the ratio.

    Returns:
        The text, three significant digits (a non-finite value as Python writes it).
    """
    return f"{value:.3g}x" if math.isfinite(value) else f"{value}"


class Message(NamedTuple):
    """What an alarm says before its fixes: its first line and its details."""

    first: str
    """What happened, at which step, in one clause."""
    details: tuple[str, ...] = ()
    """The thresholds and the evidence, one per line."""


def _dead_network_text(culprit: _Culprit, step: int) -> Message:
    """Return the text of *vanishing* for a dead network (:data:`~.gradients.DEAD_STEPS`)."""
    since = step - DEAD_STEPS + 1
    return Message(
        f"dead network at optimizer step {step}: {culprit.layer} and every layer before it get "
        f"no gradient since step {since}",
        (
            f"their gradients are exactly zero for {DEAD_STEPS} optimizer steps, while a later "
            "layer still gets one: the units after this layer stopped firing (a dead ReLU "
            "layer passes no gradient back, and does not fire again)",
        ),
    )


def _no_gradient_text(culprit: _Culprit, step: int, rules: AlarmRules) -> Message:
    """Return the text of the notice *no_gradient* for a trainable layer that got no gradient.

    Or next to none, while a layer before it gets one: :func:`_bypassed_text`.
    """
    if culprit.value > 0:
        return _bypassed_text(culprit, step, rules)
    layer = culprit.layer
    steps = rules.vanish_steps
    return Message(
        f"{layer} got no gradient in {steps} optimizer steps (to step {step}): is it used in "
        "forward?",
        (
            f"the optimizer holds its trainable parameters, but no gradient reached them (none, "
            f"or exactly 0) for {steps} consecutive optimizer steps (vanish_steps)",
            "a notice, not a warning: an unused branch, or a mixture of experts' idle expert, "
            "harms nothing while the rest trains; a frozen layer (requires_grad=False) is not "
            "watched",
        ),
    )


def _bypassed_text(culprit: _Culprit, step: int, rules: AlarmRules) -> Message:
    """Return the text of the notice *no_gradient* for a layer the gradient flows around.

    Its gradient stayed tiny while a layer before it got one.
    """
    layer, value, ref = culprit
    steps = rules.vanish_steps
    return Message(
        f"{layer} got next to no gradient in {steps} optimizer steps (to step {step}), while a "
        "layer before it gets one: is it bypassed?",
        (
            f"its grad norm {value:.3g} under {ref:.3g} (vanish_fraction={rules.vanish_fraction} "
            f"of the median non-zero layer norm) for {steps} consecutive steps",
            "a notice, not a warning: the gradient reaches the layers before it around this one "
            "(a residual block whose units are mostly dead, an idle branch), and they train",
        ),
    )


def _describe(rule: str, culprit: _Culprit, step: int, rules: AlarmRules) -> Message:
    """Return the text of a gradient rule other than *explosion*."""
    layer, value, ref = culprit
    at = f"optimizer step {step}"
    if rule == "spike":
        return Message(
            f"gradient spike at {at}: {layer} grad norm {value:.4g} is {value / ref:.3g}x its "
            "running scale",
            (
                f"running scale {ref:.4g} (spike_factor={rules.spike_factor}, "
                f"spike_sigmas={rules.spike_sigmas})",
                "one step: a transient if the next steps come back to scale (it counts in the "
                "spike score)",
            ),
        )
    if rule == "absolute":
        return Message(
            f"gradient norm above max_grad_norm at {at}: {layer} {value:.4g} > {ref:.4g}"
        )
    if rule == "vanishing":
        return Message(
            f"vanishing gradient at {at}: {layer} grad norm {value:.3g} under {ref:.3g} for "
            f"{rules.vanish_steps} steps",
            (
                f"vanish_fraction={rules.vanish_fraction} of the median non-zero layer norm, "
                f"vanish_steps={rules.vanish_steps} consecutive steps",
            ),
        )
    if rule == "no_gradient":
        return _no_gradient_text(culprit, step, rules)
    if rule == "nonfinite":
        what, order = ("weights", "forward") if not math.isfinite(ref) else ("gradient", "backward")
        return Message(
            f"non-finite {what} at {at}: {layer} (first layer in {order} order)",
            (f"{layer} grad norm {value:.4g}",),
        )
    return Message(
        f"AMP overflow at {at}: the GradScaler skipped the step",
        (f"grad norm {value:.4g}",),
    )


def _explosion_text(
    culprit: _Culprit, report: GradientReport, at: FiredStep, rules: AlarmRules
) -> Message:
    """Return the text of *explosion*: the size, and what the optimizer applies.

    The global norm's running scale, which its advice reads, is in its details.
    """
    layer, value, ref = culprit
    clip = at.clip
    global_norm = float(report.norm[-1])
    shrink = 1.0 if clip is None or global_norm <= clip else clip / global_norm
    applied = (
        "unclipped"
        if shrink == 1.0
        else f"{value * shrink / ref:.3g}x after clipping to {clip:.4g}"
    )
    return Message(
        f"gradient explosion at optimizer step {at.step}: {layer} {value / ref:.3g}x its scale, "
        f"{applied}",
        (
            f"{layer} grad norm {value:.4g}, its running scale {ref:.4g} (explode_factor="
            f"{rules.explode_factor})",
            f"the global norm's running scale is {float(report.scale[-1]):.3g}: a clip a few "
            "times it holds such a step",
            "one such step wrecks SGD's weights or poisons an adaptive optimizer's second "
            "moment for thousands of steps",
        ),
    )
