"""The alarms' every-step check on a quiet step: per-parameter norms copied to the host and folded
into layers there, against plain torch; the host copy that carries them."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_hooks import AlarmRules, GradFlowCallback
from lightning_hooks.core.alarms import HostSegments
from lightning_hooks.core.alarms.gradients import GradientRules, RunningScale
from lightning_hooks.core.alarms.loss import LossRules
from lightning_hooks.core.host_copy import HostCopy
from lightning_hooks.core.ops.grad_stats import ParamLayout, param_norms, segment_norm
from lightning_hooks.errors import TrainingAlarmWarning

FAULT = 37  # a quiet step: the Trainer logs (and the statistics sample) every 50


class TiedAutoencoder(pl.LightningModule):
    """``enc`` and ``dec`` share one weight (each layer's row has it, the global norm once), and
    ``mid`` in between; 60 batches of 16."""

    LAYERS = ("enc", "mid", "dec")

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.mid, self.dec = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.dec.weight = self.enc.weight
        g = torch.Generator().manual_seed(0)
        self.data = torch.randn(60 * 16, 8, generator=g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(torch.tanh(self.mid(torch.tanh(self.enc(x)))))  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return nn.functional.mse_loss(self(x), x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        dataset = torch.utils.data.TensorDataset(self.data)
        return torch.utils.data.DataLoader(dataset, batch_size=16)


class Probe(pl.Callback):
    """Per step, in plain torch before the every-step check reads them: each layer's gradient norm
    over the parameters it owns, and the global norm over every distinct parameter once; at
    ``FAULT`` it multiplies ``mid``'s gradient by 1e6 first."""

    def __init__(self) -> None:
        self.rows: list[list[float]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == FAULT:
            for p in pl_module.mid.parameters():
                p.grad.mul_(1e6)
        layers = [pl_module.get_submodule(n) for n in TiedAutoencoder.LAYERS]
        row = [_norm([p.grad for p in m.parameters(recurse=False)]) for m in layers]
        self.rows.append([*row, _norm([p.grad for p in pl_module.parameters()])])


def _norm(grads: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads))


def test_a_quiet_step_names_the_spike_with_the_norms_plain_torch_gives_tied_weights_included(
    tmp_path: Path,
) -> None:
    probe = Probe()
    callback = GradFlowCallback(alarms=AlarmRules(diverge_ratio=None), on_alarm={"spike": "warn"})
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        limit_train_batches=FAULT + 3,
        enable_progress_bar=False,
        callbacks=[probe, callback],
    )
    with pytest.warns(TrainingAlarmWarning) as record:
        trainer.fit(TiedAutoencoder())
    alarms = [w.message.alarm for w in record if isinstance(w.message, TrainingAlarmWarning)]
    spike = next(a for a in alarms if a.rule == "spike")
    assert (spike.step, spike.layer) == (FAULT, "mid")
    assert "global" in spike.others and "enc" not in spike.others
    # the ring buffer holds the rows the host folded on the 16 quiet steps up to the fault
    assert spike.history_steps == tuple(range(FAULT - 15, FAULT + 1))
    expected = np.array(probe.rows)[FAULT - 15 : FAULT + 1]
    np.testing.assert_allclose(np.array(spike.history), expected, rtol=1e-5)
    # the global norm counts the tied weight once: not the layers' norms summed in squares
    before = expected[:-1]  # at the fault mid's gradient is all of it
    layers_squared = np.sqrt(np.square(before[:, :3]).sum(axis=1))
    assert (np.abs(before[:, 3] - layers_squared) > 0.1 * before[:, 3]).all()


def test_the_host_fold_equals_the_device_segments() -> None:
    torch.manual_seed(0)
    model = TiedAutoencoder()
    layout = ParamLayout.from_modules([(n, model.get_submodule(n)) for n in model.LAYERS])
    keep = [True] * len(layout.params)
    unique = layout.unique_positions(keep)
    assert len(unique) < len(layout.params)  # the tied weight is listed twice
    norms = param_norms([torch.randn_like(p) for p in layout.params])
    seg = HostSegments(layout.owner, len(layout.layers), unique)
    device = segment_norm(norms, layout.index, len(layout.layers), torch.tensor(unique))
    np.testing.assert_allclose(seg.fold(norms.numpy()), device.numpy(), rtol=1e-6)
    norms[2] = math.nan  # mid's weight: its row and the global row, no other
    folded = seg.fold(norms.numpy())
    assert np.isnan(folded).tolist() == [False, True, False, True]
    # parameters not grouped by layer: the other way of summing, the same rows
    mixed = HostSegments([0, 1, 0], 2, [0, 1, 2])
    values = np.array([3.0, 5.0, 4.0], dtype=np.float32)
    np.testing.assert_allclose(mixed.fold(values), [5.0, 5.0, math.sqrt(50.0)], rtol=1e-7)


def test_the_host_copy_grows_for_a_larger_value_and_keeps_the_unread_one() -> None:
    box = HostCopy((2,), torch.device("cpu"))
    box.post(torch.tensor([1.0, 2.0]), meta="small")
    box.reserve((5,))  # larger than the buffer, with a value unread
    value, meta = box.read(wait=True)
    assert (value.tolist(), meta) == ([1.0, 2.0], "small")
    box.post(torch.arange(5.0), meta="large")
    value, meta = box.read(wait=True)
    assert (value.tolist(), meta) == ([0.0, 1.0, 2.0, 3.0, 4.0], "large")
    box.post(torch.tensor([7.0, 8.0]))  # a smaller one still lands in the larger buffer
    assert box.read(wait=True)[0].tolist() == [7.0, 8.0]


@pytest.mark.parametrize(
    "rules",
    [
        AlarmRules(max_grad_norm=1e4),
        AlarmRules(explode_factor=None),
        AlarmRules(spike_factor=None, vanish_fraction=None),
        AlarmRules(spike_factor=None, explode_factor=None),
    ],
    ids=["defaults-and-absolute", "no-explosion", "explosion-only", "no-ceiling"],
)
def test_the_rules_quiet_report_and_state_equal_the_full_evaluation(rules: AlarmRules) -> None:
    """Two rule sets on the same norms: one evaluated in full on every step (a stepped-rows
    array of its own), one that may take the quiet report: the same reports, the same state.
    The steps include spikes, an explosion, a vanishing layer, a NaN and an Inf; the rules
    with and without each ceiling (the quiet report's is the lowest of them)."""
    full, quick = GradientRules(5, rules), GradientRules(5, rules)
    rng = np.random.default_rng(0)
    norms = np.exp(rng.normal(0.0, 0.3, size=(200, 5))).astype(np.float32)
    norms[60, 1] *= 1e3  # a spike
    norms[90] *= 1e4  # an explosion, and above max_grad_norm
    norms[120:150, 3] = 1e-6  # a vanishing layer
    norms[170, 2] = np.nan
    norms[180, 4] = np.inf
    quiet = 0
    for step, norm in enumerate(norms):
        expected = full.evaluate(norm, np.ones(5, dtype=bool), False, None)
        got = quick.evaluate(norm, np.ones(5, dtype=bool), False, None, every_row_active=True)
        quiet += got is quick.quiet
        for field, want in zip(got._fields, expected, strict=True):
            np.testing.assert_array_equal(
                getattr(got, field), want, err_msg=f"step {step}: {field}"
            )
        np.testing.assert_array_equal(quick.scale.state, full.scale.state)
        np.testing.assert_array_equal(quick.low, full.low)
    assert 100 < quiet < 190  # both paths were taken


def test_the_ceilings_of_every_factor_made_at_once_equal_each_made_alone() -> None:
    """``RunningScale.thresholds`` against the documented formula, one factor at a time:
    ``mean + max(spike_sigmas * std, log(factor))`` where armed, ``inf`` elsewhere."""
    scale = RunningScale(40, AlarmRules())
    rng = np.random.default_rng(1)
    scale.state[0] = rng.normal(0.0, 3.0, 40)
    scale.state[1] = np.abs(rng.normal(0.0, 1.0, 40))
    scale.state[2] = rng.integers(0, 6, 40)  # armed from min_history=3 finite steps
    for factors in [(10.0, 300.0), (math.inf,), (math.inf, 300.0)]:
        ceilings, armed, bands = scale.thresholds(*factors)
        assert armed.tolist() == (scale.state[2] >= 3).tolist()
        spread = np.sqrt(scale.var) * scale.sigmas
        for factor, ceiling, band in zip(factors, ceilings, bands, strict=True):
            alone = np.maximum(spread, np.float32(math.log(factor)))
            assert ceiling.dtype == band.dtype == np.float32
            np.testing.assert_array_equal(band, np.where(armed, alone, np.inf))
            np.testing.assert_array_equal(ceiling, np.where(armed, alone + scale.mean, np.inf))
    armed = scale.state[2] >= 3
    scale.state[2] = 100.0  # every row armed, the EMA's weight at its floor
    assert scale.steady()
    for factors in [(10.0, 300.0), (math.inf, 300.0), (10.0,)]:
        logs = [np.float32(math.log(f)) for f in factors]
        low = None if min(logs) == logs[0] else min(logs)
        band = np.zeros(40, dtype=np.float32)
        top = scale.quiet_ceiling(low, band, logs[0]).copy()
        ceilings, _, bands = scale.thresholds(*factors)
        np.testing.assert_array_equal(top, np.minimum.reduce(ceilings))
        np.testing.assert_array_equal(band, bands[0])
    steady, full = RunningScale(40, AlarmRules()), RunningScale(40, AlarmRules())
    steady.state[...] = full.state[...] = scale.state
    log_x = rng.normal(0.0, 1.0, 40).astype(np.float32)
    steady.update_steady(log_x)
    full.update(log_x, np.ones(40, dtype=bool), np.full(40, np.inf, dtype=np.float32))
    np.testing.assert_array_equal(steady.state, full.state)
    scale.load(torch.from_numpy(np.where(armed, 100.0, 0.0).astype(np.float32)).expand(3, 40))
    assert not scale.steady()  # a loaded state is looked at again


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_loss_rules_meet_any_loss_without_raising(adaptive: bool) -> None:
    """*diverging* on losses over 60 orders of magnitude, near ``float32``'s largest (where a
    sum overflows), below zero, NaN and Inf: no exception, a non-finite loss is warned at its
    step, and the levels stay what a finite loss made them."""
    rng = np.random.default_rng(7)
    for run in range(40):
        scale = 10.0 ** rng.uniform(-30, 38.5)
        with np.errstate(over="ignore"):  # some overflow to inf: a loss that does
            losses = (scale * np.exp(rng.normal(0.0, 1.0, 60))).astype(np.float32)
        losses[rng.integers(0, 60, 3)] = [np.nan, np.inf, -np.inf][run % 3]
        if run % 4 == 0:
            losses *= np.float32(-1.0)  # a loss below zero (a log-likelihood, say)
        if run % 4 == 1:  # either sign near float32's largest: a difference overflows
            losses = np.float32(3e38) * np.sign(rng.normal(size=60)).astype(np.float32)
        rules = LossRules(AlarmRules(), torch.device("cpu"))
        rules.adaptive = adaptive
        for step, x in enumerate(losses.tolist()):
            before = dataclasses.replace(rules.levels)
            with np.errstate(all="ignore"):
                alarms = rules.evaluate(x, step)
            if not math.isfinite(x):
                assert "diverging" in [a.rule for a in alarms], (run, step)
                assert rules.levels == before, (run, step)  # a non-finite loss moves nothing
