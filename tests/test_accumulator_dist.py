"""The accumulator's cross-rank rules in one process: another rank's states are supplied by
replacing the one all-gather (the real 2-process run is tests/test_distributed.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from lightning_hooks.core import LayerStatsAccumulator
from lightning_hooks.core.stats import accumulator as accumulator_module
from lightning_hooks.core.stats import stat as states_module


def test_steps_batch_equals_one_update_per_step() -> None:
    values = torch.tensor([[[1.0], [5.0]], [[3.0], [-2.0]], [[7.0], [4.0]]])
    valid = torch.tensor([[[True], [True]], [[True], [False]], [[False], [True]]])
    batched, stepwise = (
        LayerStatsAccumulator(["a", "b"], ["x"]),
        LayerStatsAccumulator(["a", "b"], ["x"]),
    )
    batched.update(values, valid=valid)
    for v, m in zip(values, valid, strict=True):
        stepwise.update(v, valid=m)
    got, want = batched.result(), stepwise.result()
    assert got.total.tolist() == want.total.tolist() == [[4.0], [9.0]]
    assert got.peak.tolist() == want.peak.tolist() == [[3.0], [5.0]]
    assert got.count.tolist() == want.count.tolist() == [[2.0], [2.0]]


def test_replicated_values_are_recorded_by_rank_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    acc = LayerStatsAccumulator(["a"], ["x"])
    monkeypatch.setattr(accumulator_module, "rank", lambda: 1)
    acc.update(torch.tensor([[2.0]]), replicated=True)
    acc.update(torch.tensor([[3.0]]))  # rank-local values count on every rank
    assert acc.result().total.tolist() == [[3.0]]


def test_one_all_gather_sums_totals_and_counts_and_maxes_peaks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    acc = LayerStatsAccumulator(["a", "b"], ["x"])
    acc.update(torch.tensor([[1.0], [4.0]]))
    other = (
        torch.stack(
            [
                torch.tensor([[5.0], [0.0]]),
                torch.tensor([[5.0], [-math.inf]]),
                torch.tensor([[1.0], [0.0]]),
            ]
        )
        .reshape(-1)
        .double()
    )  # rank 1: a saw 5 once, b nothing
    calls: list[torch.Tensor] = []

    def gather(packed: torch.Tensor, group: Any = None) -> torch.Tensor:
        calls.append(packed)
        return torch.stack([packed, other])

    monkeypatch.setattr(states_module, "all_gather_stacked", gather)
    monkeypatch.setattr(states_module, "is_distributed", lambda: True)
    result = acc.result()
    assert len(calls) == 1 and calls[0].shape == (6,)  # total, peak, count: one packed tensor
    assert result.total.tolist() == [[6.0], [4.0]] and result.count.tolist() == [[2.0], [1.0]]
    assert result.peak.tolist() == [[5.0], [4.0]] and result.mean.tolist() == [[3.0], [4.0]]
    assert acc.total.tolist() == [[1.0], [4.0]]  # local states restored: accumulation goes on


def test_a_loaded_state_is_counted_once_across_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank loads the checkpoint's reduced epoch on the host; only windows are reduced."""
    saved = LayerStatsAccumulator(["a"], ["x"])
    saved.update(torch.tensor([[2.0]]))
    state = saved.host_state()
    fresh = LayerStatsAccumulator(["a"], ["x"])
    fresh.load_host_state(state)
    fresh.update(torch.tensor([[4.0]]))  # this rank's next step; the other rank saw 6
    other = torch.tensor([6.0, 6.0, 1.0], dtype=torch.float64)  # total, peak, count

    def gather(packed: torch.Tensor, group: Any = None) -> torch.Tensor:
        return torch.stack([packed, other])

    monkeypatch.setattr(states_module, "all_gather_stacked", gather)
    monkeypatch.setattr(states_module, "is_distributed", lambda: True)
    result = fresh.result()
    assert result.count.tolist() == [[3.0]] and result.total.tolist() == [[12.0]]
    assert result.peak.tolist() == [[6.0]]
    with pytest.raises(
        ValueError, match=r"saved for layers=\('a',\).*this one has layers=\('b',\)"
    ):
        LayerStatsAccumulator(["b"], ["x"]).load_host_state(state)
