"""The logging step's batched activation statistics: small outputs copied in their hooks and
measured together by shape and dtype (``stacked_feature_stats``), against each output measured
in its own hook (``feature_stats``)."""

from __future__ import annotations

import pytest
import torch
from ops import OpCounter
from torch import nn

from lightning_hooks import ActivationStatsTracker
from lightning_hooks.core.ops import feature_stats as feature_stats_module
from lightning_hooks.core.ops import tensors
from lightning_hooks.core.ops.feature_stats import feature_stats, stacked_feature_stats


@pytest.mark.parametrize("device", ["cpu", "other"], ids=["cpu-signs", "comparisons"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_row_is_that_tensors_feature_stats(
    dtype: torch.dtype, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways of counting: the CPU's sums of signs, and the comparisons off it (run here on
    the CPU by counting as off it)."""
    torch.manual_seed(0)
    x = (torch.randn(5, 3, 7) * 10).to(dtype)
    x[1, 0, :3] = 0.0
    x[2, 1, 1] = float("nan")
    x[3, 2, 2] = float("inf")
    x[0, 2, 4] = -float("inf")
    x[4] = -x[4].abs()
    if device == "other":
        monkeypatch.setattr(feature_stats_module, "SIGN_COUNTS", frozenset())
    got = stacked_feature_stats(x)
    want = torch.stack([feature_stats(t) for t in x])
    assert got.dtype == torch.float32 and got.shape == (5, 8)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0, equal_nan=True)
    assert torch.equal(got[:, 3:6], want[:, 3:6])  # zeros, non-finite and element counts


class _Net(nn.Module):
    """Linear layers each followed by an in-place ReLU (which overwrites the Linear's output
    after its hook ran), one of them called twice, and a tanh head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Sequential(nn.Linear(8, 3), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in [*self.body, self.body[0]]:
            x = self.relu(layer(x))
        return self.head(x)


def _measured(batched: bool, nan_at: int | None = None) -> tuple[object, object]:
    torch.manual_seed(1)
    net = _Net()
    tracker = ActivationStatsTracker(net, types=(nn.Linear, nn.ReLU, nn.Tanh))
    tracker._batched = batched
    for step in range(3):
        x = torch.randn(16, 8)
        if step == nan_at:
            x[3, 2] = float("nan")
        net(x)
        tracker.end_step(step)
    first = tracker.first_nonfinite.poll()
    return tracker.summary(), first


def test_the_batch_gives_the_statistics_each_hook_gave() -> None:
    """In-place ReLUs, a module called twice (its row pools both calls), the first non-finite
    module and step: as when each output was measured in its hook."""
    for nan_at in (None, 1):
        (got, got_first), (want, want_first) = _measured(True, nan_at), _measured(False, nan_at)
        assert got.layers == want.layers and got_first == want_first
        for name in ("mean", "std", "min", "max", "abs_mean", "zero_fraction", "nonfinite"):
            np_got, np_want = got.column(name), want.column(name)
            torch.testing.assert_close(
                torch.as_tensor(np_got),
                torch.as_tensor(np_want),
                rtol=1e-6,
                atol=1e-7,
                equal_nan=True,
            )
    assert _measured(True, 1)[1] is not None


def test_copies_beyond_the_cap_are_measured_early_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    want, _ = _measured(True)
    monkeypatch.setattr(tensors, "_HELD", 100)  # every output or two
    got, _ = _measured(True)
    for name in ("mean", "std", "min", "max"):
        torch.testing.assert_close(
            torch.as_tensor(got.column(name)), torch.as_tensor(want.column(name))
        )


def test_a_small_output_costs_one_op_in_its_hook() -> None:
    """A copy in the hook (grad is off there: no detach); the 17 ops of its statistics run once
    per shape and dtype, at the end of the step: a 40-layer MLP's forward dispatches 1 op per
    hooked output beyond bare (its rows made in a first forward)."""
    net = nn.Sequential(*(m for _ in range(20) for m in (nn.Linear(8, 8), nn.ReLU())))
    x = torch.randn(4, 8)
    counter = OpCounter()
    with counter:
        net(x)
    bare = counter.total
    tracker = ActivationStatsTracker(net)
    net(x)  # the rows are made
    tracker.drain()
    counter = OpCounter()
    with counter:
        net(x)
    hooked = counter.total
    counter = OpCounter()
    with counter:
        tracker.drain()
    tracker.remove()
    assert hooked - bare == 40, counter.ops
    assert counter.total <= 2 * 20  # Linear's and ReLU's outputs are one shape: one batch


def test_copies_of_a_step_cut_short_go_with_the_hooks() -> None:
    net = _Net()
    tracker = ActivationStatsTracker(net)
    net(torch.randn(4, 8))
    assert len(tracker._pending) == 12  # 5 Linear calls, 5 ReLU, the head's Linear and Tanh
    tracker.remove()
    assert len(tracker._pending) == 0 and tracker._pending._held == 0
