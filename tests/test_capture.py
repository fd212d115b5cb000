"""capture_outputs: feature extraction in a plain PyTorch loop, hooks gone on every exit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hooks.core.hooks.capture import capture_outputs

from conftest import hooks_left


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)
    )


def test_outputs_equal_a_manual_forward_and_hooks_are_removed() -> None:
    model, x = _model(), torch.randn(5, 3, 8, 8)
    with capture_outputs(model, ["0", "3"], clone=True) as features:
        out = model(x)
    conv = model[0](x)
    torch.testing.assert_close(features["0"], conv, rtol=0, atol=0)
    torch.testing.assert_close(features["3"], out.detach(), rtol=0, atol=0)
    assert not features["0"].requires_grad
    assert hooks_left(model) == []


def test_without_clone_an_inplace_relu_overwrites_the_detached_output() -> None:
    model, x = _model(), -torch.ones(1, 3, 8, 8)
    with capture_outputs(model, "0") as shared, capture_outputs(model, "0", clone=True) as copy:
        model(x)
    assert (shared["0"] >= 0).all()  # the ReLU after it ran in place
    assert (copy["0"] < 0).any()


def test_detach_false_keeps_the_graph_for_a_feature_loss() -> None:
    model = _model()
    with capture_outputs(model, "0", detach=False) as features:
        model(torch.randn(2, 3, 8, 8))
    features["0"].pow(2).mean().backward()
    assert model[0].weight.grad is not None and model[3].weight.grad is None


def test_glob_patterns_select_every_matching_module() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Tanh()), nn.Linear(2, 1))
    with capture_outputs(model, "0.*") as features:
        model(torch.zeros(1, 2))
    assert sorted(features) == ["0.0", "0.1"]


def test_unknown_name_lists_the_closest_names_and_leaves_no_hooks() -> None:
    model = _model()
    with (
        pytest.raises(ValueError, match=r"include='3x'\) matches no module.*closest.*'3'"),
        capture_outputs(model, ["0", "3x"]),
    ):
        pass
    assert hooks_left(model) == []
    with (
        pytest.raises(ValueError, match=r"layers=\.\.\.\): expected at least one name"),
        capture_outputs(model, []),
    ):
        pass


def test_hooks_removed_when_the_block_raises() -> None:
    model = _model()
    with pytest.raises(RuntimeError, match="stop"), capture_outputs(model, "0"):
        model(torch.randn(1, 3, 8, 8))
        raise RuntimeError("stop")
    assert hooks_left(model) == []
