"""LayerStat callbacks under DDP (gloo, 2 CPU processes) against one process on the same global
batches, and the user-defined statistic of ``examples/custom_stat.py`` against plain torch."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from ddp_run import SAMPLES
from ddp_stats_run import AttentionMLP, fit, routed_fit

from conftest import epoch_end_step, read_scalars, run_script

PREFIXES = ("output_rms/", "activations/", "dead_relu/", "saturation/", "stability/")


@pytest.fixture(scope="module")
def ddp_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp_stats")
    run_script("ddp_stats_run.py", out)
    return out


class _Recorder:
    """Every Linear output of the training forwards, kept by plain hooks of the test's own."""

    def __init__(self, model: AttentionMLP) -> None:
        self.outputs: dict[str, list[torch.Tensor]] = {}
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
            if module.training and torch.is_grad_enabled():
                self.outputs.setdefault(name, []).append(output.detach().double().clone())

        return hook


def test_output_rms_under_ddp_equals_plain_torch_on_the_global_batches(ddp_out: Path) -> None:
    model = AttentionMLP(batch_size=SAMPLES // 4)
    recorder = _Recorder(model)
    model.train()
    loader = model.train_dataloader()
    optimizer = model.configure_optimizers()
    ddp = read_scalars(ddp_out / "tb")
    for epoch, step in enumerate((epoch_end_step(4), epoch_end_step(8))):
        for x, y in loader:  # the same plain SGD steps the fit took
            optimizer.zero_grad()
            model.training_step((x, y), 0).backward()
            optimizer.step()
        for name, outputs in recorder.outputs.items():
            x = torch.cat([o.flatten() for o in outputs[4 * epoch : 4 * epoch + 4]])
            want = float(x.square().mean().sqrt())
            ((got,),) = [[v for s, v in ddp[f"output_rms/{name}"] if s == step]]
            assert math.isclose(got, want, rel_tol=1e-5), (name, epoch, got, want)
    assert len(recorder.outputs) == 5  # the attention's qkv and the MLP's 4 Linear layers


def test_every_layer_stat_under_ddp_equals_one_process(ddp_out: Path, tmp_path: Path) -> None:
    fit(tmp_path, devices=1).restore()
    single, ddp = read_scalars(tmp_path / "tb"), read_scalars(ddp_out / "tb")
    tags = {t for t in single if t.startswith(PREFIXES)}
    assert {t.split("/")[0] + "/" for t in tags} == set(PREFIXES)
    # the attention's per-head entropy: sums and row counts pooled over the ranks, so the mean
    # over the global batch (each rank's own mean, or the smallest of them, differs)
    assert {"stability/attn_entropy_min/attn", "stability/attn_logit_max/attn"} <= tags
    assert {t for t in ddp if t.startswith(PREFIXES)} == tags
    stepped = {t for t in tags if "_step" in t}  # each logging step's values (every step)
    assert {t.split("/")[0] + "/" for t in stepped} == set(PREFIXES)
    for tag in sorted(tags):
        steps = list(range(8)) if tag in stepped else [epoch_end_step(4), epoch_end_step(8)]
        assert [s for s, _ in ddp[tag]] == [s for s, _ in single[tag]] == steps, tag
        for (_, got), (_, want) in zip(ddp[tag], single[tag], strict=True):
            assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-9), (tag, got, want)


def test_one_collective_and_one_agreement_per_statistic_per_logging_step(ddp_out: Path) -> None:
    for rank in (0, 1):
        report = json.loads((ddp_out / f"rank{rank}.json").read_text())
        # one all_gather per statistic (6: ActivationStatsCallback holds two) at each of an
        # epoch's 4 logging steps and at its end, and one small all_reduce per callback (5 of
        # them): the ranks' agreement on a failure (one more each at the end of the fit)
        # and, when rows were made since the last logging step, one all_gather_object of the
        # new rows' names: each callback's at its first logging step (StabilityStats' output
        # layer's row, settled before its rows are gathered, with the others); none in the
        # second epoch
        assert [e["ours"] for e in report["epochs"]] == [(6 + 5) * 5 + 5, (6 + 5) * 5]
        assert report["ours"] == {
            "all_gather": 2 * 5 * 6,
            "all_reduce": 2 * 5 * 5 + 5,
            "all_gather_object": 5,
        }


def test_a_layer_one_rank_meets_first_is_measured_as_in_one_process(
    ddp_out: Path, tmp_path: Path
) -> None:
    """Rows are made when a layer is first observed: the expert of ``RoutedMLP`` is met by
    rank 0 at step 0 and by rank 1 only at step 1. The ranks align their rows at the logging
    point (before, the one collective failed: "Received data size doesn't match"), and every
    value equals one process on the global batches."""
    routed_fit(tmp_path, devices=1)
    single = read_scalars(tmp_path / "tb")
    ddp = read_scalars(ddp_out / "routed" / "tb")
    tags = {t for t in single if t.startswith("activations/")}
    assert any(t.endswith("/expert") for t in tags), sorted(tags)
    assert {t for t in ddp if t.startswith("activations/")} == tags
    for tag in sorted(tags):
        assert [s for s, _ in ddp[tag]] == [s for s, _ in single[tag]], tag
        for (_, got), (_, want) in zip(ddp[tag], single[tag], strict=True):
            assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-9), (tag, got, want)
