"""The TensorBoard custom-scalars dashboard: one multiline chart per statistic, all layers in it.

Scalar tags are ``<family>/<stat>/<layer>``, ``<family>/global/<stat>`` (``<stat>_p50``: a
percentile over layers) or ``<family>/alarms/<rule>``; a logging step's value has ``_step``
after its statistic (:func:`step_tag`, Lightning's convention), so it never shares a curve with
the epoch's. One chart per ``(family, stat)`` (its layers and global lines) and one per family's
alarms: the panels grow with the statistics, not the layers. Categories lead with gradient flow,
then alarms, activations, dead units, the rest by name.

:func:`record_tags` sees every scalar logged; :func:`write_dashboard` writes a writer's layout
again only when a new chart appears (TensorBoard reads the last one written).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

__all__ = [
    "MAX_CHARTS",
    "chart_key",
    "dashboard_layout",
    "record_tags",
    "step_tag",
    "step_tags",
    "write_dashboard",
]

MAX_CHARTS = 64
"""At most this many charts in one run's layout; the families' own tags beyond it are dropped."""

_CATEGORY_PREFIX = "lightning_hooks"
_CATEGORY_ORDER = ("grad_flow", "alarms", "activations", "dead_relu")
# Within a category: the statistics a reader looks at first (the rest by name).
_CHART_ORDER = (
    "attn_logit_max",
    "attn_entropy_min",
    "grad_norm",
    "output_grad_norm",
    "update_ratio",
    "grad_abs_mean",
    "grad_nonfinite",
    "dead_fraction",
    "zero_fraction",
    "abs_mean",
    "std",
    "mean",
)
_PERCENTILE = re.compile(r"_p\d+$")
# Tags seen per TensorBoard writer, and the charts already written to it.
_SEEN: weakref.WeakKeyDictionary[Any, set[tuple[str, str]]] = weakref.WeakKeyDictionary()
_WRITTEN: weakref.WeakKeyDictionary[Any, frozenset[tuple[str, str]]] = weakref.WeakKeyDictionary()

STEP = "_step"
"""The suffix of a statistic's name in the tags of one logging step."""
_TAGS = 1 << 16  # tags whose derived names are kept (each logging step writes the same ones)


@lru_cache(maxsize=_TAGS)
def step_tag(tag: str) -> str:
    """The tag of ``tag``'s value at one logging step: ``_step`` after the statistic's name.

    Example:
        >>> step_tag("grad_flow/grad_norm/encoder.0"), step_tag("grad_flow/global/grad_norm_p50")
        ('grad_flow/grad_norm_step/encoder.0', 'grad_flow/global/grad_norm_step_p50')
        >>> step_tag("layer_time/step_ms"), step_tag("grad_flow/alarms/spike")
        ('layer_time/step_ms_step', 'grad_flow/alarms_step/spike')
    """
    parts = tag.split("/")
    at = 2 if len(parts) > 2 and parts[1] == "global" else min(1, len(parts) - 1)
    percentile = _PERCENTILE.search(parts[at])
    cut = percentile.start() if percentile else len(parts[at])
    parts[at] = parts[at][:cut] + STEP + parts[at][cut:]
    return "/".join(parts)


def step_tags(values: Mapping[str, float]) -> dict[str, float]:
    """``values`` under their :func:`step_tag`."""
    return {step_tag(tag): value for tag, value in values.items()}


@lru_cache(maxsize=_TAGS)
def chart_key(tag: str) -> tuple[str, str] | None:
    """The ``(family, stat)`` chart a tag belongs to, or ``None`` for a tag outside the scheme.

    Example:
        >>> chart_key("grad_flow/grad_norm/encoder.0"), chart_key("grad_flow/global/grad_norm_p50")
        (('grad_flow', 'grad_norm'), ('grad_flow', 'grad_norm'))
        >>> chart_key("train/loss") is None
        True
    """
    parts = tag.split("/")
    if len(parts) < 3 or not all(parts):
        return None
    if parts[1] == "global":
        return parts[0], _PERCENTILE.sub("", parts[2])
    return parts[0], parts[1]


def dashboard_layout(keys: Iterable[tuple[str, str]]) -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout of the given charts, for ``SummaryWriter.add_custom_scalars``.

    One category per family (``lightning_hooks: grad_flow``) and one for the alarms, at most
    :data:`MAX_CHARTS` charts, in the order the module docstring gives.

    Example:
        >>> keys = [("dead_relu", "dead_fraction"), ("grad_flow", "update_ratio"),
        ...         ("grad_flow", "alarms"), ("activations", "std"), ("grad_flow", "grad_norm")]
        >>> layout = dashboard_layout(keys)
        >>> [(title.split(": ")[1], list(charts)) for title, charts in layout.items()]
        ... # doctest: +NORMALIZE_WHITESPACE
        [('grad_flow', ['grad_norm', 'update_ratio']), ('alarms', ['grad_flow']),
         ('activations', ['std']), ('dead_relu', ['dead_fraction'])]
        >>> kind, (per_layer, overall) = layout["lightning_hooks: grad_flow"]["grad_norm"]
        >>> kind, per_layer, bool(re.match(overall, "grad_flow/global/grad_norm_p50"))
        ('Multiline', '^grad_flow/grad_norm/.*', True)
    """
    layout: dict[str, dict[str, list[Any]]] = {}
    for family, stat in sorted(set(keys), key=_chart_rank)[:MAX_CHARTS]:
        regexes = [f"^{re.escape(family)}/{re.escape(stat)}/.*"]
        if stat.removesuffix(STEP) == "alarms":  # chart grad_flow or grad_flow_step
            category, chart = "alarms", family + stat.removeprefix("alarms")
        else:
            category, chart = family, stat
            regexes.append(f"^{re.escape(family)}/global/{re.escape(stat)}(_p\\d+)?$")
        layout.setdefault(f"{_CATEGORY_PREFIX}: {category}", {})[chart] = ["Multiline", regexes]
    return layout


def _chart_rank(key: tuple[str, str]) -> tuple[int, str, int, str]:
    """Sort key of a chart: its category's rank, then the statistic's."""
    family, stat = key
    base = stat.removesuffix(STEP)
    category = "alarms" if base == "alarms" else family
    first = _CATEGORY_ORDER.index(category) if category in _CATEGORY_ORDER else len(_CATEGORY_ORDER)
    within = _CHART_ORDER.index(base) if base in _CHART_ORDER else len(_CHART_ORDER)
    # A statistic's epoch chart first, its per-step chart right after.
    return first, category, within, f"{family}/{base}/{stat != base:d}"


def record_tags(writer: Any, tags: Iterable[str]) -> None:
    """Remember the scalar tags written to ``writer`` (their charts go into its layout)."""
    keys = {key for key in map(chart_key, tags) if key is not None}
    if keys:
        _SEEN.setdefault(writer, set()).update(keys)


def write_dashboard(writers: Sequence[Any]) -> None:
    """Write each writer's layout if it has charts it has not written yet."""
    for writer in writers:
        keys = frozenset(_SEEN.get(writer, ()))
        if not keys or keys <= _WRITTEN.get(writer, frozenset()):
            continue
        writer.add_custom_scalars(dashboard_layout(keys))
        _WRITTEN[writer] = keys
