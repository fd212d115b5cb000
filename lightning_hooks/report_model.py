"""What ``lightning-hooks report`` knows of a run: the metrics the library logs, and one run's
last step per layer (:class:`LayerRow`, :class:`RunReport`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ALARMS", "COLUMNS", "LAYER_METRICS", "LayerRow", "RunReport"]

COLUMNS: tuple[tuple[str, str], ...] = (
    ("dead_fraction", "dead_relu/dead_fraction"),
    ("grad_norm", "grad_flow/grad_norm"),
    ("update_ratio", "grad_flow/update_ratio"),
    ("grad_nonfinite", "grad_flow/grad_nonfinite"),
)
"""The table's columns: ``(name, family/stat)``; every other statistic is in the JSON only."""

LAYER_METRICS: dict[str, tuple[str, ...]] = {
    "grad_flow": (
        "grad_norm",
        "grad_norm_max",
        "grad_abs_mean",
        "grad_abs_max",
        "grad_nonfinite",
        "weight_norm",
        "update_ratio",
        "update_ratio_max",
        "output_grad_norm",
        "output_grad_norm_max",
    ),
    "activations": ("mean", "std", "min", "max", "abs_mean", "zero_fraction", "nonfinite"),
    "dead_relu": ("dead_fraction", "dead_count", "zero_fraction"),
    "saturation": ("saturated_fraction", "always_saturated_fraction"),
    "layer_time": ("forward_ms", "share"),
    "feature_map": ("abs_mean",),
    "stability": ("attn_logit_max", "attn_entropy_min", "logit_logz", "logit_logz_max"),
}
"""Every per-layer ``family/stat`` the library's callbacks log (a test holds it to a real fit)."""

ALARMS: dict[str, tuple[str, ...]] = {
    "grad_flow": (
        "spike",
        "explosion",
        "absolute",
        "vanishing",
        "nonfinite",
        "amp_overflow",
        "loss_spike",
        "diverging",
        "stall",
        "attention",
    ),
}
"""Every ``family/alarms/rule`` count the library logs (``lightning_hooks.core.ALARM_RULES``)."""

_HEALTHY_UPDATE_RATIO = 1e-3  # the usual rule of thumb for ||dw|| / ||w|| per step


@dataclass
class LayerRow:
    """One layer's statistics at the last logged step (every ``family/stat`` found)."""

    layer: str
    values: dict[str, float] = field(default_factory=dict)

    def get(self, name: str) -> float:
        """A column by its short name (``grad_norm``) or full ``family/stat``; NaN if absent."""
        full = dict(COLUMNS).get(name, name)
        return self.values.get(full, math.nan)

    def severity(self) -> tuple[float, float, float, float]:
        """Sort key, worst first: non-finite gradients, no gradient at all, dead fraction, then
        the update ratio's distance from 1e-3 in decades."""
        norm = self.values.get("grad_flow/grad_norm", 1.0)
        broken = self.get("grad_nonfinite") > 0 or not math.isfinite(norm)
        dead = self.get("dead_fraction")
        ratio = self.get("update_ratio")
        off = abs(math.log10(ratio / _HEALTHY_UPDATE_RATIO)) if ratio > 0 else math.inf
        return (
            -float(broken),
            -float(norm == 0),
            -(dead if not math.isnan(dead) else 0.0),
            -(off if not math.isnan(ratio) else 0.0),
        )


@dataclass
class RunReport:
    """The last step of one run: its layers worst first, its global values, and its alarm
    counts per ``family/rule`` summed over the whole run."""

    run: str
    step: int
    layers: list[LayerRow]
    global_values: dict[str, float]
    alarms: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (NaN becomes ``None``)."""

        def clean(values: dict[str, float]) -> dict[str, float | None]:
            return {k: (None if math.isnan(v) else v) for k, v in values.items()}

        return {
            "run": self.run,
            "step": self.step,
            "alarms": clean(self.alarms),
            "global": clean(self.global_values),
            "layers": [{"layer": r.layer, **clean(r.values)} for r in self.layers],
        }
