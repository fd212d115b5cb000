"""The *attention* rule: attention collapse (Wortsman et al. 2023, arXiv 2309.14322), read on the
host from what the attention capture measured on a logging step."""

from __future__ import annotations

import math
from collections.abc import Mapping

from lightning_hooks.core.alarms.messages import _ADVICE, GradientAlarm
from lightning_hooks.core.alarms.rules import AlarmRules

__all__ = ["attention_alarms"]


def attention_alarms(
    logit_max: Mapping[str, float],
    entropy_min: Mapping[str, float],
    step: int,
    rules: AlarmRules,
) -> list[GradientAlarm]:
    """*attention*'s alarms at a logging step: the layers whose largest pre-softmax logit is
    above ``rules.attn_logit_max`` while their smallest head entropy (nats) is below
    ``rules.attn_entropy_min`` (one-hot softmax, vanishing gradient), when at least
    ``rules.attn_min_layers`` layers (every layer, in a model with fewer) collapsed at once. A
    layer without an entropy is judged on its logit.

    Example:
        >>> rules = AlarmRules()
        >>> [a.layer for a in attention_alarms({"h.0": 5e4, "h.1": 2e3, "h.2": 20.0},
        ...                                    {"h.0": 0.01, "h.1": 0.05, "h.2": 0.01}, 99, rules)]
        ['h.0', 'h.1']
        >>> attention_alarms({"h.0": 5e4, "h.1": 20.0}, {"h.0": 0.01, "h.1": 2.0}, 99, rules)
        []
    """
    limit, floor = rules.attn_logit_max, rules.attn_entropy_min
    if limit is None:
        return []
    collapsed = [
        (layer, peak, entropy)
        for layer, peak in logit_max.items()
        if (peak > limit or math.isnan(peak))
        and not (entropy := entropy_min.get(layer, math.nan)) >= floor
    ]
    if len(collapsed) < min(rules.attn_min_layers, len(logit_max)):
        return []
    alarms = []
    for layer, peak, entropy in collapsed:
        text = (
            f"attention collapse at optimizer step {step} in {layer!r}: its largest attention "
            f"logit is {peak:.4g} (attn_logit_max={limit:g}) and its most focused head's "
            f"entropy {entropy:.3g} nats (attn_entropy_min={floor:g}): the softmax is one-hot "
            "and its gradient vanishes (Wortsman et al. 2023, arXiv 2309.14322). Fixes that "
            f"work: {_ADVICE['attention']}"
        )
        alarms.append(GradientAlarm("attention", layer, step, peak, limit, text))
    return alarms
