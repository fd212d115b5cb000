"""FSDP2 on CPU (gloo, 2 processes) against one process on the same global batches.

One launch of ``tests/fsdp_run.py`` (about 30 s on 2 shared cores) serves every test here: the
FSDP2 and HSDP fits with every statistic, accumulation with clipping, the every-step check's
``skip`` and ``stop`` on a NaN that only one rank's shard holds, ``examples/fsdp2.py`` and the
tensor-parallel refusal.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fsdp_run import NAN_STEP, ShardedMLP, run
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning import Trainer
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.strategies import FSDPStrategy, SingleDeviceStrategy

from lightning_hooks import GradFlowCallback
from lightning_hooks.core.ops.grouped_norms import abs_sum_max
from lightning_hooks.core.sharding import ShardPlan, combine_partials
from lightning_hooks.errors import TrainingAlarmWarning

from conftest import epoch_end_step, read_histograms, read_scalars, run_script

STEPS = [4, 8]  # two epochs of four optimizer steps, logged at each epoch end


@pytest.fixture(scope="module")
def fsdp_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    run_script("fsdp_run.py", out)
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The one-process reference fits, ``devices=1``, for every run."""
    out = tmp_path_factory.mktemp("single")
    runs = {name: run(out, name, devices=1) for name in ("fsdp", "clip")}
    for action in ("skip", "stop"):
        with pytest.warns(TrainingAlarmWarning, match="non-finite"):
            runs[action] = run(out, action, devices=1)
    return out, runs


def _report(out: Path, rank: int) -> dict[str, Any]:
    return json.loads((out / f"rank{rank}.json").read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize("mesh", ["fsdp", "hsdp"])
def test_every_tag_equals_one_process(
    mesh: str, fsdp_out: Path, single: tuple[Path, dict[str, Any]]
) -> None:
    report = _report(fsdp_out, 1)
    assert (report["world_size"], report["backend"]) == (2, "gloo")
    want_placement = "(Shard(dim=0),)" if mesh == "fsdp" else "(Replicate(), Shard(dim=0))"
    assert set(report[mesh]["placements"].values()) == {want_placement}
    want = read_scalars(single[0] / "fsdp" / "tb")
    got = read_scalars(fsdp_out / mesh / "tb")
    families = {tag.split("/")[0] for tag in want}
    # no stability/: the regressor's one output has no log-partition, and there is no attention
    assert families == {"grad_flow", "activations", "dead_relu", "saturation"}, families
    _assert_same_scalars(got, want)


def _assert_same_scalars(
    got: dict[str, list[tuple[int, float]]],
    want: dict[str, list[tuple[int, float]]],
    steps: list[int] = STEPS,
) -> None:
    """``steps``: the optimizer steps made by each epoch's end."""
    epochs = [epoch_end_step(stepped) for stepped in steps]
    assert set(got) == set(want)
    assert any("_step" in tag for tag in want)  # each logging step's values are compared too
    for tag in sorted(want):
        at = [s for s, _ in want[tag]]
        assert [s for s, _ in got[tag]] == at and ("_step" in tag or at == epochs), tag
        for (_, value), (_, reference) in zip(got[tag], want[tag], strict=True):
            same = math.isclose(value, reference, rel_tol=1e-4, abs_tol=1e-7)
            assert same or (math.isnan(value) and math.isnan(reference)), (tag, value, reference)


def test_accumulation_and_clipping_equal_one_process(
    fsdp_out: Path, single: tuple[Path, dict[str, Any]]
) -> None:
    want = read_scalars(single[0] / "clip" / "tb")
    pre = [v for _, v in want["grad_flow/global/grad_norm_preclip"]]
    post = [v for _, v in want["grad_flow/global/grad_norm_postclip"]]
    assert post[0] < pre[0]  # clipped: the post-clip norm is made whole across shards too
    _assert_same_scalars(read_scalars(fsdp_out / "clip" / "tb"), want, [2, 4])


@pytest.mark.parametrize("mesh", ["fsdp", "hsdp"])
def test_histograms_equal_one_process(
    mesh: str, fsdp_out: Path, single: tuple[Path, dict[str, Any]]
) -> None:
    want = read_histograms(single[0] / "fsdp" / "tb")
    got = read_histograms(fsdp_out / mesh / "tb")
    assert {t.split("/")[:2][0] + "/" + t.split("/")[1] for t in want} == {
        "grad_flow/grad_log10_abs",
        "activations/histogram",
    }
    assert set(got) == set(want)
    for tag in want:
        for (step, h), (ref_step, ref) in zip(got[tag], want[tag], strict=True):
            assert step == ref_step
            assert list(h.bucket_limit) == pytest.approx(list(ref.bucket_limit)), tag
            assert list(h.bucket) == list(ref.bucket), tag  # counts: exact
            assert h.num == ref.num


def test_sharded_weights_have_an_empty_shard(fsdp_out: Path) -> None:
    # Linear(3, 1) over two ranks: rank 1's shards of net.4 are empty; its statistics still
    # match (test_every_tag_equals_one_process covers grad_flow/*/net.4).
    weights = _report(fsdp_out, 1)["fsdp"]["weights"]
    assert np.asarray(weights["net.4.weight"]).shape == (1, 3)


def test_collectives_per_step_and_epoch(fsdp_out: Path) -> None:
    for rank in (0, 1):
        report = _report(fsdp_out, rank)
        fsdp, hsdp, skip = report["fsdp"], report["hsdp"], report["skip"]  # batches = steps
        # Per logging step, whatever the number of layers: one all_gather of every parameter's
        # packed gradient and weight partials (which the every-step check reads too), one of the
        # update's; each is a logging step: one all_reduce (output gradients) and one all_gather
        # each (the accumulator, the instability statistics), one all_gather per statistic for
        # activations (two: ActivationStatsCallback holds the activation shape too), dead units
        # and saturation; and one all_reduce of the loss (the diverging rule reads the mean
        # over ranks) at every batch, which carries GradFlowCallback's agreement of the ranks on a
        # failure or a stop; the 3 statistics callbacks agree in one small all_reduce each.
        # At the first logging step, each statistics callback's new rows: one all_gather_object
        # (the rows' names) each, once.
        assert fsdp["steps"] == [2 + 3 + 4 + 1 + 3 + 3] + [2 + 3 + 4 + 1 + 3] * 7
        # The every-step check alone (off the statistics' cadence): one all_gather of the gradient
        # norms; at NAN_STEP, where it fires, one more: the weights, read only then.
        # every_n_steps=4 samples steps 0, 3, 4 and 7 (each + 3 at its logging step); + 1 each:
        # the loss.
        assert NAN_STEP == 5
        assert skip["steps"] == [6, 2, 2, 6, 6, 3, 2, 6]
        # Per epoch, GradFlowCallback alone: the steps', then one all_gather (the accumulator's
        # window since the last logging step) and one all_gather (the instability statistics),
        # and one all_reduce: the ranks' agreement at the epoch end.
        # (the second epoch holds NAN_STEP: + the weights' attribution pass)
        assert [e["ours_by_name"] for e in skip["epochs"]] == [
            {"all_gather": 5 + 2 + 3 + 1 + 1, "all_reduce": 2 + 4 + 1},
            {"all_gather": 5 + 2 + 3 + 1 + 1 + 1, "all_reduce": 2 + 4 + 1},
        ]
        # Every callback: + the gradient histogram's counts over the shard group, and one packed
        # all_gather per statistic for activations (two), dead units and saturation, one for the
        # instability statistics; the agreements: each callback's at the epoch end, the 3
        # statistics callbacks' at each logging step.
        agreements = 1 + 3 * (4 + 1)
        epoch = {
            "all_gather": 4 * (2 + 1 + 4 + 1) + 1 + 4 + 1,
            "all_reduce": 4 + 4 + 1 + agreements,
        }
        assert [e["ours_by_name"] for e in fsdp["epochs"]] == [
            {**epoch, "all_gather_object": 3},  # the new rows' names, at the first logging step
            epoch,
        ]
        # Accumulating 2 batches, clipped: one more all_gather, of the post-clip norms (+ 3 at
        # the logging step); the loss's all_reduce at every batch.
        assert report["clip"]["steps"] == [1, 3 + 3 + 1] * 4
        # HSDP (replicate=2, shard=1): a shard group of one rank makes no collective of its own;
        # the logging steps' reduce across the replicas.
        # The loss's all_reduce spans the whole world: the replicas' batches differ.
        assert hsdp["steps"] == [2 + 3 + 2 + 1 + 3 + 3] + [2 + 3 + 2 + 1 + 3] * 7
        epoch = {"all_gather": 4 * (1 + 4 + 1) + 1 + 4 + 1, "all_reduce": 4 + 4 + agreements}
        assert [e["ours_by_name"] for e in hsdp["epochs"]] == [
            {**epoch, "all_gather_object": 3},
            epoch,
        ]


@pytest.mark.parametrize("action", ["skip", "stop"])
def test_alarm_actions_agree_across_ranks_and_with_one_process(
    action: str, fsdp_out: Path, single: tuple[Path, dict[str, Any]]
) -> None:
    # The NaN is in rank 0's shard only: rank 1 acts on the same verdict because the every-step
    # check reads the whole gradient.
    ranks = [_report(fsdp_out, r)[action] for r in (0, 1)]
    reference = single[1][action]
    for got in ranks:
        assert got["global_step"] == reference["global_step"]
        for name, value in reference["weights"].items():
            np.testing.assert_allclose(
                got["weights"][name], value, rtol=1e-4, atol=1e-6, err_msg=name
            )
    want = read_scalars(single[0] / action / "tb")
    got_tags = read_scalars(fsdp_out / action / "tb")
    assert want["grad_flow/alarms/nonfinite"][-1][1] > 0
    if action == "stop":
        assert reference["global_step"] == NAN_STEP + 1  # stopped after the NaN step
        assert want["grad_flow/grad_nonfinite/net.0"][-1][1] == 1  # the NaN step, counted
    else:
        assert all(np.isfinite(np.asarray(v)).all() for v in reference["weights"].values())
    # Every tag: the same value as in one process (stop: the second epoch ends after step 5).
    _assert_same_scalars(got_tags, want, [4, 6] if action == "stop" else STEPS)


def test_example_trains_sharded_and_logs_whole_model_statistics(fsdp_out: Path) -> None:
    scalars = read_scalars(fsdp_out / "example" / "runs" / "fsdp2")
    layers = ("net.0", "net.2", "net.4")
    assert {f"grad_flow/grad_norm/{layer}" for layer in layers} <= set(scalars)
    assert {f"activations/mean/{layer}" for layer in layers} <= set(scalars)
    # 256 samples, 32 a batch, half of them per rank: 4 steps an epoch, logged at each end.
    epochs = [epoch_end_step(4), epoch_end_step(8)]
    assert [s for s, _ in scalars["grad_flow/global/grad_norm"]] == epochs


def test_tensor_parallel_is_refused_naming_what_is_supported(fsdp_out: Path) -> None:
    for rank in (0, 1):
        message = _report(fsdp_out, rank)["tensor_parallel"]
        assert "tensor_parallel_size=2" in message
        assert "Supported: ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)" in (
            message
        )


def test_partials_of_shards_combine_to_the_whole_tensor() -> None:
    # Shard-local partials (sum of squares, |x| sum, |x| max) of a [5, 3] tensor split by rows
    # over 4 ranks (2, 2, 1 and an empty shard), combined, against the whole tensor.
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(5, 3, generator=g)
    shards = [whole[0:2], whole[2:4], whole[4:5], whole[5:]]
    assert shards[-1].numel() == 0
    partials = torch.stack(
        [
            torch.stack(
                [
                    torch.linalg.vector_norm(s).square().view(1),
                    *abs_sum_max([s]),
                ],
                dim=1,
            )
            for s in shards
        ]
    )
    combined = combine_partials(partials, num_sums=2)[0]
    want = [torch.linalg.vector_norm(whole) ** 2, whole.abs().sum(), whole.abs().max()]
    torch.testing.assert_close(combined, torch.stack(want))
    # A NaN in one shard reaches the sums and the maximum.
    partials[1, 0, :] = torch.nan
    assert torch.isnan(combine_partials(partials, num_sums=2)).all()


def test_layouts_that_would_give_wrong_numbers_are_refused(fsdp_out: Path) -> None:
    errors = _report(fsdp_out, 0)["refused_layouts"]
    assert "parameter 1 of shape (3,) is a plain tensor" in errors["mixed"]
    assert "apply fully_shard to the root module too" in errors["mixed"]
    assert "placements (Shard(dim=0), Shard(dim=1))" in errors["two_dims"]
    assert "supported: Shard along one mesh dimension" in errors["two_dims"]


def test_unsharded_parameters_make_no_plan() -> None:
    assert ShardPlan.from_params(list(torch.nn.Linear(2, 2).parameters())) is None


class DeepSpeedStrategy(SingleDeviceStrategy):
    """Named like Lightning's (deepspeed is not installed here): refused by class name."""


@pytest.mark.parametrize("strategy", [FSDPStrategy, DeepSpeedStrategy])
def test_fsdp1_and_deepspeed_are_refused_pointing_to_fsdp2(strategy: type, tmp_path: Path) -> None:
    trainer = Trainer(accelerator="cpu", devices=1, logger=TensorBoardLogger(str(tmp_path)))
    # Lightning refuses FSDP1 on a CPU accelerator: the strategy is put on the trainer by hand
    # and setup called as Trainer.fit would.
    trainer._accelerator_connector.strategy = (
        strategy() if strategy is FSDPStrategy else strategy(device="cpu")
    )
    name = strategy.__name__
    with pytest.raises(
        MisconfigurationException,
        match=rf"strategy={name}\).*Use ModelParallelStrategy\(data_parallel_size=N, "
        r"tensor_parallel_size=1\) with fully_shard",
    ):
        GradFlowCallback().setup(trainer, ShardedMLP(), "fit")
