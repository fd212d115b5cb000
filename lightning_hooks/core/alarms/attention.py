"""The *attention* rule: an attention layer whose softmax collapses to one key.

It runs at the logging steps, on the largest attention logit and the most focused head's
entropy that the instability statistics measure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import pairwise

from lightning_hooks.core.alarms.messages import TrainingAlarm
from lightning_hooks.core.alarms.rules import AlarmRules

__all__ = ["attention_alarms"]


def _under_or_nan(value: float, bound: float) -> bool:
    """Return whether ``value`` is under ``bound``; a NaN counts as under (it harms the model)."""
    return not value >= bound


def _over_or_nan(value: float, bound: float) -> bool:
    """Return whether ``value`` is over ``bound``; a NaN counts as over (it harms the model)."""
    return not value <= bound


def _at_least_or_nan(value: float, bound: float) -> bool:
    """Return whether ``value`` is at least ``bound``; a NaN counts as at least."""
    return not value < bound


def attention_alarms(
    logit_max: Mapping[str, float],
    entropy_min: Mapping[str, float],
    step: int,
    rules: AlarmRules,
    history: Mapping[str, Sequence[float]] | None = None,
) -> list[TrainingAlarm]:
    """Return *attention*'s alarms at a logging step, by the ``attn_*`` thresholds of ``rules``.

    A layer without an entropy is judged on its logit.

    Args:
        logit_max: each attention layer's largest attention logit.
        entropy_min: each attention layer's most focused head's mean entropy, in nats.
        step: the optimizer step, quoted by the alarms.
        rules: the alarm rules, whose ``attn_*`` thresholds apply.
        history: each layer's logits at the logging steps before, oldest first.

    Returns:
        One alarm per collapsing layer.

    Example:
        >>> rules = AlarmRules()
        >>> [a.layer for a in attention_alarms({"h.0": 5e4, "h.1": 2e3, "h.2": 20.0},
        ...                                    {"h.0": 0.01, "h.1": 0.05, "h.2": 0.01}, 99, rules)]
        ['h.0', 'h.1']
        >>> attention_alarms({"h.0": 5e4, "h.1": 20.0}, {"h.0": 0.01, "h.1": 2.0}, 99, rules)
        []
        >>> grown = {"h.0": [150.0, 300.0], "h.1": [300.0, 400.0]}
        >>> [a.layer for a in attention_alarms({"h.0": 500.0, "h.1": 450.0}, {"h.0": 0.02,
        ...     "h.1": 0.5}, 149, rules, grown)]
        ['h.0']
        >>> attention_alarms({"h.0": 500.0, "h.1": 45.0}, {"h.0": 0.02, "h.1": 0.5}, 149, rules,
        ...                  grown)
        []
    """
    limit = rules.attn_logit_max
    floor = rules.attn_entropy_min
    growth = rules.attn_growth
    history = history or {}
    focused = {}
    for layer, peak in logit_max.items():
        entropy = entropy_min.get(layer, math.nan)
        if _under_or_nan(entropy, floor):
            focused[layer] = (peak, entropy)
    need = min(rules.attn_min_layers, len(logit_max))
    high = [
        layer
        for layer, (peak, _) in focused.items()
        if limit is not None and _over_or_nan(peak, limit)
    ]
    high = high if len(high) >= need else []
    growing = []
    if growth is not None:
        for layer, (peak, _) in focused.items():
            past = [*history.get(layer, ())[-2:], peak]
            if (
                len(past) == 3
                and past[0] >= rules.attn_logit_min
                and all(b >= growth * a for a, b in pairwise(past))
            ):
                growing.append(layer)
    if sum(_at_least_or_nan(peak, rules.attn_logit_min) for peak in logit_max.values()) < need:
        growing = []
    alarms = []
    for layer, (peak, entropy) in focused.items():
        if layer not in high and layer not in growing:
            continue
        why = (
            f"is {peak:.4g} (attn_logit_max={limit:g})"
            if layer in high
            else f"grew from {history[layer][-2]:.4g} to {peak:.4g} over the last two logging "
            f"steps (attn_growth={growth:g} per logging step, from attn_logit_min="
            f"{rules.attn_logit_min:g})"
        )
        text = (
            f"attention collapse at optimizer step {step} in {layer!r}: largest logit "
            f"{peak:.4g}, most focused head's entropy {entropy:.3g} nats"
        )
        details = (
            f"its largest attention logit {why}; its most focused head's entropy "
            f"{entropy:.3g} nats (attn_entropy_min={floor:g})",
            "the softmax is one-hot and its gradient vanishes (Wortsman et al. 2023, arXiv "
            "2309.14322)",
        )
        alarms.append(
            TrainingAlarm("attention", layer, step, peak, limit or math.nan, text, details=details)
        )
    return alarms
