"""The format of the state `TrainingAlarms` saves, and the upgrade of older formats to it.

A state saved by this release carries its format's number under ``"version"``
(:data:`STATE_VERSION`). A state without one is either release 0.2.0's or of the layout saved
after it, before states carried a version; :func:`upgrade` rewrites either into the current
format, so that :meth:`TrainingAlarms.load_state_dict` reads that format alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import torch

from lightning_hooks.core.alarms.gradients import as_array
from lightning_hooks.core.alarms.loss import LossLevels
from lightning_hooks.core.alarms.stall import StallState

__all__ = ["STATE_VERSION", "VERSION", "upgrade"]

VERSION = "version"
"""The key of a state's format number."""

STATE_VERSION = 1
"""The format this release saves, and the only numbered one it reads."""

_SAVED_WITHOUT_VERSION = (
    "states saved without a version (release 0.2.0's, and the layout saved after it)"
)


def upgrade(state: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``state`` in the current format, without changing ``state``.

    Args:
        state: what :meth:`TrainingAlarms.state_dict` returned, in this release or an earlier
            one.

    Returns:
        The state in the format :data:`STATE_VERSION`, its values those saved.

    Raises:
        ValueError: the state carries a version this release does not read, or it is older
            than release 0.2.0.
    """
    version = state.get(VERSION)
    if version is None:
        return _from_layout_without_version(state)
    if version != STATE_VERSION:
        raise ValueError(
            f"TrainingAlarms.load_state_dict: a state of version {version!r}; this release "
            f"reads version {STATE_VERSION} and {_SAVED_WITHOUT_VERSION}"
        )
    return dict(state)


def _from_layout_without_version(state: Mapping[str, Any]) -> dict[str, Any]:
    """Return a state saved without a version in the current format.

    Release 0.2.0's format is first rewritten into the layout that followed it. That layout
    gained entries over time: each one a state lacks takes the value a new instance starts
    from, as it did when such a state was loaded before states carried a version.

    Args:
        state: a state without a version.

    Returns:
        The state in the format :data:`STATE_VERSION`.

    Raises:
        ValueError: the state is older than release 0.2.0 (it has no running scale).
    """
    if "scale" not in state:
        raise ValueError("TrainingAlarms.load_state_dict: a state of an older version")
    # Release 0.2.0 held the loss levels as "diverging"; the layout after it, as "loss_levels".
    layout = dict(state) if "loss_levels" in state else _from_release_0_2_0(state)
    defaults: dict[str, Any] = {
        "dead": (-1, 0),
        "loss_setback": None,
        "loss_recent": [],
        "loss_echo": None,
        # The first whole optimizer step counts the losses per step again.
        "loss_per_step": 1,
        "loss_step": None,
        "loss_group": [0, 0.0],
        "loss_start": math.nan,
        "loss_peak": [-1, -math.inf],
        "loss_trail": [],
        "stall": torch.from_numpy(StallState().array()),
        "peak_lr": 0.0,
        # Without the epoch's alarms, the epoch's text starts from the resume.
        "log": [],
    }
    return {**defaults, **layout, VERSION: STATE_VERSION}


def _from_release_0_2_0(state: Mapping[str, Any]) -> dict[str, Any]:
    """Return release 0.2.0's state in the layout that followed it.

    Release 0.2.0 held *diverging*'s state as ``[mean, deviation, best, first]`` beside the
    losses seen and its open rise, and counted a setback that recovered as ``transient``. A
    deviation from the mean stands in for the jitter: both measure the loss's noise. A state
    without *diverging*'s state starts *diverging* afresh.

    Args:
        state: a state in release 0.2.0's format.

    Returns:
        The state with ``loss_levels`` in place of *diverging*'s state, and its count of
        setbacks under ``setback``.
    """
    layout = {
        key: value
        for key, value in state.items()
        if key not in ("diverging", "loss_seen", "loss_rise")
    }
    levels = LossLevels()
    if "diverging" in state:
        mean, deviation, best, first = as_array(state["diverging"]).tolist()
        levels = LossLevels(
            seen=int(state["loss_seen"]),
            first=first,
            mean=mean,
            level=mean,
            best=best,
            jitter=deviation,
            last=mean,
        )
    layout["loss_levels"] = asdict(levels)
    counts = dict(state["counts"])
    if "transient" in counts:
        counts["setback"] = counts.pop("transient")
    layout["counts"] = counts
    return layout
