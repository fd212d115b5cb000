"""What to try when an alarm fires: each rule's fixes, the one most likely to work first.

The fixes come in the order the evidence of the run says. Every alarm's advice comes from here,
once.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["Advice", "Evidence", "advise"]

_LOWER_LR = "lower the learning rate"
_CLIP = "clip gradients (gradient_clip_val)"
_TENFOLD = f"{_LOWER_LR} (10x)"

_FIXES: dict[str, tuple[str, ...]] = {
    "spike": ("if it repeats, clip gradients", f"if it repeats, {_CLIP} or {_LOWER_LR}"),
    "explosion": (
        "{clip}",
        "skip such steps: on_alarm={'explosion': 'skip'}",
        _LOWER_LR,
    ),
    "absolute": (_CLIP, _LOWER_LR),
    "vanishing": (
        "check the layer is used and trainable",
        "check its initialisation and the activations that feed it (DeadReLUCallback)",
    ),
    "nonfinite": (_LOWER_LR, _CLIP, "train in bf16, or float16 with a GradScaler"),
    "loss_spike": ("look at this step's batch", f"{_LOWER_LR} if it repeats"),
    "diverging": (
        _LOWER_LR,
        "add warm-up",
        _CLIP,
        "resume from the last good checkpoint",
    ),
    "stall": (
        "reset the optimizer's state",
        "resume from a checkpoint before the explosion that poisoned its second moment",
        _CLIP,
        "check that the learning rate is what you meant",
    ),
    "attention": (
        "add qk-layernorm",
        "qk-layernorm is a LayerNorm on each head's queries and keys before their product",
        _LOWER_LR,
        "cap the attention logits (cap * tanh(logit / cap), as Gemma 2 does)",
    ),
}
"""Each rule's fixes, the one most likely to work first when the loss has not diverged. The
rules without advice: *setback* (watched: most recover) and *amp_overflow* (the GradScaler
acts)."""


class Evidence(NamedTuple):
    """What the run shows beside the alarm, which orders its fixes."""

    loss_diverged: bool = False
    """The loss's running mean is over *diverging*'s bar (a setback open or confirmed), or the
    loss is not finite: a learning rate too high, which clipping alone does not hold."""
    global_scale: float = math.nan
    """The global gradient norm's running scale, for the clip value *explosion* suggests."""
    network_cut: bool = False
    """A layer and every layer before it get exactly zero gradient: a learning rate too high
    killed a layer's units, and only a lower one avoids it."""
    learning_rate: float = math.nan
    """The optimizer's learning rate when the alarm was written (NaN: not known), quoted where
    the advice is to lower it."""


class Advice(NamedTuple):
    """An alarm's fixes, and why they come in that order when the evidence moved one first."""

    fixes: tuple[str, ...]
    """The fixes, the one most likely to work first (empty: none needed)."""
    why: str = ""
    """Why the first one leads, when the evidence put it there (``""``: the rule's own order)."""
    rate: str = ""
    """The run's learning rate, where a fix is to lower it and the rate is known (``""``: not)."""


def advise(rule: str, evidence: Evidence | None = None) -> Advice:
    """Return ``rule``'s fixes, the one most likely to work first.

    When the loss diverged too, a lower learning rate comes before clipping and skipping.

    Args:
        rule: the alarm rule that fired (``"explosion"``, ``"stall"``, ...).
        evidence: what the run shows beside the alarm, which orders the fixes and gives the
            clip value and the learning rate quoted (``None``: nothing known).

    Returns:
        The fixes (empty for a rule without advice), why the first leads where the evidence
        moved it there, and the learning rate where a fix is to lower it.

    Example:
        >>> advise("explosion", Evidence(global_scale=0.3)).fixes[0]
        'clip gradients at gradient_clip_val=1.5'
        >>> advise("explosion", Evidence(loss_diverged=True, global_scale=0.3)).fixes[:2]
        ('lower the learning rate', 'clip gradients at gradient_clip_val=1.5')
        >>> advise("setback")
        Advice(fixes=(), why='', rate='')
        >>> advise("vanishing", Evidence(network_cut=True)).fixes[0]
        'lower the learning rate (10x)'
        >>> advise("diverging", Evidence(learning_rate=0.3)).rate
        'the learning rate is 0.3; 0.03, 10x lower, is the usual first step'
    """
    seen = evidence if evidence is not None else Evidence()
    advice = _advise(rule, seen)
    lr = seen.learning_rate
    if not math.isfinite(lr) or not any(fix.startswith(_LOWER_LR) for fix in advice.fixes):
        return advice
    rate = f"the learning rate is {lr:.3g}; {lr / 10:.3g}, 10x lower, is the usual first step"
    return Advice(advice.fixes, advice.why, rate)


def _advise(rule: str, seen: Evidence) -> Advice:
    """Return :func:`advise`'s fixes and why, the learning rate not yet quoted."""
    if rule == "vanishing" and seen.network_cut:
        why = (
            "a whole layer that stopped firing is what a learning rate too high leaves: restart "
            "from before it (a lower learning rate; 10x is the usual first step)"
        )
        return Advice((_TENFOLD, *_FIXES["vanishing"]), why)
    scale = seen.global_scale
    value = f"{5.0 * scale:.2g}" if math.isfinite(scale) and scale > 0 else "a few times it"
    clip = f"clip gradients at gradient_clip_val={value}"
    found = tuple(fix.replace("{clip}", clip) for fix in _FIXES.get(rule, ()))
    if not seen.loss_diverged or _LOWER_LR not in found or found[0] == _LOWER_LR:
        return Advice(found)
    why = "the loss diverged too: a learning rate too high, which clipping alone does not hold"
    return Advice((_LOWER_LR, *(fix for fix in found if fix != _LOWER_LR)), why)
