"""Name the tags of a gradient-flow table: which layers are logged and under which names.

The names are ``grad_flow/{stat}/{layer}``, ``grad_flow/global/{stat}`` and their percentiles.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from lightning_hooks.core.stats.accumulator import LayerTable
from lightning_hooks.tags import grad_flow_tag

__all__ = ["grad_flow_scalars", "logged_rows"]


class Logged(NamedTuple):
    """Name one tag per layer: its suffix, the table's statistic and its reduction over steps."""

    suffix: str
    stat: str
    kind: str
    """``"mean"``, ``"peak"`` or ``"total"`` (a :meth:`LayerTable.column` kind)."""


_LOGGED = tuple(
    Logged(*row)
    for row in (
        ("grad_norm", "grad_norm", "mean"),
        ("grad_norm_max", "grad_norm", "peak"),
        ("grad_abs_mean", "grad_abs_mean", "mean"),
        ("grad_abs_max", "grad_abs_max", "peak"),
        ("grad_nonfinite", "grad_nonfinite", "total"),
        ("weight_norm", "weight_norm", "mean"),
        ("update_ratio", "update_ratio", "mean"),
        ("update_ratio_max", "update_ratio", "peak"),
        ("output_grad_norm", "output_grad_norm", "mean"),
        ("output_grad_norm_max", "output_grad_norm", "peak"),
        ("grad_norm_preclip", "grad_norm_preclip", "mean"),
    )
)
_PERCENTILES = (5, 50, 95)


def grad_flow_scalars(
    stats: LayerTable, max_layers: int | None, *, step: bool
) -> Iterator[tuple[str, float]]:
    """Yield the tagged scalars of a gradient-flow table, for an epoch or a logging step.

    They are the means per layer and over the model, the peaks and totals, and beyond
    ``max_layers`` layers percentiles over them all.

    Args:
        stats: the gradient-flow table, the global row last.
        max_layers: the most layers logged one by one (``None``: all).
        step: a logging step's scalars, without the peaks (``*_max``); else an epoch's.

    Yields:
        ``(tag, value)`` of each scalar.
    """
    last = len(stats.layers) - 1  # the global row
    rows = logged_rows(stats, max_layers)
    if stats.count[-1, stats.stats.index("grad_norm_preclip")] > 0:  # clipped: the applied one
        yield grad_flow_tag("grad_norm_postclip"), float(stats.column("grad_norm")[-1])
    for suffix, stat, kind in _LOGGED:
        if step and suffix != stat:
            continue
        column = stats.column(stat, kind)
        counts = stats.count[:, stats.stats.index(stat)]
        for row in (*rows, last):
            if counts[row] == 0:
                continue
            layer = stats.layers[row]
            tag = grad_flow_tag(suffix, None if row == last else layer)
            yield tag, float(column[row])
        values = column[:last][(counts[:last] > 0) & np.isfinite(column[:last])]
        if len(rows) < last and values.size:  # percentiles over the layers
            for q, value in zip(_PERCENTILES, np.percentile(values, _PERCENTILES), strict=True):
                yield grad_flow_tag(f"{suffix}_p{q:02d}"), float(value)


def logged_rows(stats: LayerTable, max_layers: int | None) -> list[int]:
    """Return the layer rows of ``stats`` to log.

    Args:
        stats: a gradient-flow table, the global row last.
        max_layers: the most rows returned (``None``: all).

    Returns:
        All the layer rows, or the non-finite first, then half the largest and half the smallest
        gradient norms.
    """
    num_layers = len(stats.layers) - 1
    if max_layers is None or num_layers <= max_layers:
        return list(range(num_layers))
    norm = stats.column("grad_norm")[:num_layers]
    nonfinite = stats.column("grad_nonfinite", "total")[:num_layers]
    bad = [int(i) for i in np.flatnonzero((nonfinite > 0) | ~np.isfinite(norm))][:max_layers]
    order = [int(i) for i in np.argsort(np.where(np.isfinite(norm), norm, np.inf)) if i not in bad]
    top = (max_layers - len(bad)) // 2
    smallest = order[: max_layers - len(bad) - top]
    largest = order[len(order) - top :] if top else []
    return sorted({*bad, *smallest, *largest})
