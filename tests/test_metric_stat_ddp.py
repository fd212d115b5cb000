"""``MetricStat`` under DDP (gloo, 2 CPU processes, ``ddp_metric_run.py``): each layer's value
equals the same torchmetrics metric updated by hand on both ranks' outputs, a layer that one
rank alone runs included, and the layers' states cost one all-gather per metric state."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from ddp_metric_run import DEPTHS
from torchmetrics import MeanMetric

from conftest import epoch_end_step, read_scalars, run_script

STEPS = 4  # optimizer steps an epoch, each a logging step


@pytest.fixture(scope="module")
def ddp_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp_metric")
    run_script("ddp_metric_run.py", out)  # a hang fails it: the launch has a timeout
    return out


def _outputs(out: Path, depth: int) -> list[dict[str, list[torch.Tensor]]]:
    return [torch.load(out / f"outputs{depth}_rank{r}.pt") for r in (0, 1)]


@pytest.mark.parametrize("depth", DEPTHS)
def test_each_layer_equals_the_metric_updated_by_hand_on_both_ranks_outputs(
    ddp_out: Path, depth: int
) -> None:
    ranks = _outputs(ddp_out, depth)
    logged = read_scalars(ddp_out / f"depth{depth}" / "tb")
    layers = set(ranks[0]) | set(ranks[1])
    assert {t for t in logged if t.startswith("metrics/")} == {
        f"metrics/output_mean/{layer}" for layer in layers
    }
    for epoch, step in enumerate((epoch_end_step(STEPS), epoch_end_step(2 * STEPS))):
        for layer in sorted(layers):
            metric = MeanMetric()
            for outputs in ranks:
                for output in outputs.get(layer, [])[STEPS * epoch : STEPS * (epoch + 1)]:
                    metric.update(output)
            want = float(metric.compute())
            got = dict(logged[f"metrics/output_mean/{layer}"])[step]
            assert math.isclose(got, want, rel_tol=1e-6), (layer, epoch, got, want)


def test_a_layer_one_rank_alone_runs_is_computed_from_that_rank(ddp_out: Path) -> None:
    rank0, rank1 = _outputs(ddp_out, DEPTHS[0])
    assert "expert" in rank0 and "expert" not in rank1
    logged = dict(read_scalars(ddp_out / f"depth{DEPTHS[0]}" / "tb")["metrics/output_mean/expert"])
    for epoch, step in enumerate((epoch_end_step(STEPS), epoch_end_step(2 * STEPS))):
        seen = torch.cat(
            [o.flatten() for o in rank0["expert"][STEPS * epoch : STEPS * (epoch + 1)]]
        )
        assert math.isclose(logged[step], float(seen.double().mean()), rel_tol=1e-5)


def test_one_all_gather_per_metric_state_at_an_epoch_end_whatever_the_layers(
    ddp_out: Path,
) -> None:
    """Per epoch, for 5 and for 22 layers: at each of the 4 logging steps and at the epoch end
    the callback's one ``all_reduce`` (the ranks' agreement on a failure; one more at the end of
    the fit); at the epoch end one ``all_gather`` of the rows' update counts and one per state
    of ``MeanMetric`` (``mean_value``, ``weight``) for all the layers; at the first logging step
    one ``all_gather_object`` of the new rows (the expert's on rank 0 only). torchmetrics' own
    sync of the same clones: a ``barrier`` and an ``all_gather`` per state per layer."""
    for rank in (0, 1):
        report = json.loads((ddp_out / f"rank{rank}.json").read_text())
        for depth in DEPTHS:
            run = report[f"depth{depth}"]
            layers = depth + 2  # the blocks, the head and the expert
            assert run["layers"] == layers - rank  # rank 1 never runs the expert
            assert run["epochs"] == [
                {"all_reduce": STEPS + 1, "all_gather": 1 + 2, "all_gather_object": 1},
                {"all_reduce": STEPS + 1, "all_gather": 1 + 2},
            ]
            assert run["torchmetrics"] == {"barrier": 2 * layers, "all_gather": 2 * layers}


def test_a_mid_epoch_resume_under_ddp_logs_what_the_uninterrupted_fit_logs(
    ddp_out: Path,
) -> None:
    """Each rank saves its own states into the checkpoint (rank 0 writes them all) and takes
    its own back: rank 1's row of the expert, which it never ran, stays empty."""
    saved = torch.load(ddp_out / "ckpt" / "epoch=1-step=6.ckpt", weights_only=False)["callbacks"]
    (state,) = [v["0:MetricStat"] for k, v in saved.items() if k.startswith("StatsCallback")]
    expert = state["layers"].index("expert")
    weights = state["metric_states"]["weight"]
    assert weights.shape == (2, 5)  # ranks, layers
    assert weights[0, expert] == 2 * 4 * 8 and weights[1, expert] == 0  # steps 4, 5 on rank 0
    whole = read_scalars(ddp_out / "whole" / "tb")
    resumed = read_scalars(ddp_out / "resumed" / "tb")
    tags = {t for t in whole if t.startswith("metrics/")}
    assert len(tags) == 5 and {t for t in resumed if t.startswith("metrics/")} == tags
    for tag in sorted(tags):
        ((step, got),) = resumed[tag]  # the resumed fit logs its epoch 1 only
        assert step == epoch_end_step(2 * STEPS)
        assert math.isclose(got, dict(whole[tag])[step], rel_tol=1e-6), tag
