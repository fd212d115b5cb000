"""What ``GradFlowCallback`` logs from a :class:`~lightning_hooks.core.LayerStats`: scalars
bounded for deep models (at most ``max_layers`` layers' tags plus percentiles over all layers)
and the per-layer gradient histograms."""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import lru_cache

import numpy as np
import pytorch_lightning as pl
import torch

from lightning_hooks.core import LayerHistograms, LayerStats, ParamLayout
from lightning_hooks.core.transport.distributed import ShardPlan
from lightning_hooks.logging import log_histogram

__all__ = [
    "grad_flow_scalars",
    "grad_flow_step_scalars",
    "logged_rows",
    "observe_histograms",
    "write_histograms",
]

# (tag suffix, statistic, reduction over the epoch's optimizer steps)
_LOGGED: tuple[tuple[str, str, str], ...] = (
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


_PERCENTILES = (5, 50, 95)
_PERCENTILE_SUFFIX = re.compile(r"_p\d+$")


def grad_flow_scalars(
    stats: LayerStats, max_layers: int | None = None
) -> Iterator[tuple[str, float]]:
    """``(tag, value)`` of every scalar of an epoch (see ``GradFlowCallback``'s table)."""
    last = len(stats.layers) - 1  # the global row
    rows = logged_rows(stats, max_layers)
    if stats.count[-1, stats.stats.index("grad_norm_preclip")] > 0:  # clipped: the applied one
        yield "grad_flow/global/grad_norm_postclip", float(stats.column("grad_norm")[-1])
    for suffix, stat, kind in _LOGGED:
        column = stats.column(stat, kind)
        counts = stats.count[:, stats.stats.index(stat)]
        for row in (*rows, last):
            if counts[row] == 0:
                continue
            layer = stats.layers[row]
            tag = f"grad_flow/global/{suffix}" if row == last else f"grad_flow/{suffix}/{layer}"
            yield tag, float(column[row])
        if len(rows) < last:
            yield from _percentiles(suffix, column[:last][counts[:last] > 0])


# A logging step's window is one measured step: its max is its mean, logged once.
_EPOCH_ONLY = frozenset({"grad_norm_max", "update_ratio_max", "output_grad_norm_max"})


def grad_flow_step_scalars(stats: LayerStats, max_layers: int | None = None) -> dict[str, float]:
    """The scalars of one logging step's window, by their epoch tag (no ``*_max`` duplicates)."""
    return {tag: value for tag, value in grad_flow_scalars(stats, max_layers) if _per_step(tag)}


@lru_cache(maxsize=1 << 16)
def _per_step(tag: str) -> bool:
    """Whether an epoch tag has a per-step value (not a ``*_max`` duplicate of one)."""
    stat = tag.split("/")[-1 if "/global/" in tag else 1]
    return _PERCENTILE_SUFFIX.sub("", stat) not in _EPOCH_ONLY


def logged_rows(stats: LayerStats, max_layers: int | None) -> list[int]:
    """Layer rows to log: all, or non-finite first, then the largest and smallest grad norms."""
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


def _percentiles(suffix: str, values: np.ndarray) -> Iterator[tuple[str, float]]:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return
    for q, value in zip(_PERCENTILES, np.percentile(values, _PERCENTILES), strict=True):
        yield f"grad_flow/global/{suffix}_p{q:02d}", float(value)


def observe_histograms(
    hist: LayerHistograms, layout: ParamLayout, optimizer: torch.optim.Optimizer
) -> None:
    """Count the gradients ``optimizer`` is about to apply into ``hist``, per layer."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    pairs = [
        (p, row)
        for p, row in zip(layout.params, layout.owner, strict=True)
        if p.grad is not None and id(p) in stepped
    ]
    grads = ParamLayout.grads([p for p, _ in pairs])  # sparse: the coalesced values
    hist.update(grads, [row for _, row in pairs])


def write_histograms(
    trainer: pl.Trainer,
    hist: LayerHistograms,
    stats: LayerStats,
    max_layers: int | None,
    shards: ShardPlan | None,
) -> None:
    """Write the epoch's histograms of the logged layers (rank 0), then reset ``hist``."""
    # Gradients are all-reduced before the optimizer step: rank 0's counts are every rank's.
    # FSDP2: each rank counted its shard's entries; the whole gradient is their sum.
    counts = (
        hist.host_counts() if shards is None else shards.sum(hist.counts).cpu().double().numpy()
    )
    limits = hist.limits()
    hist.reset()
    if not trainer.is_global_zero:
        return
    for row in logged_rows(stats, max_layers):
        if counts[row].any():
            tag = f"grad_flow/grad_log10_abs/{stats.layers[row]}"
            log_histogram(trainer.loggers, tag, limits, counts[row], trainer.global_step)
