"""The warning through ``Trainer.fit`` on the families of ``benchmarks/divergence.py``. A healthy
byte-level transformer on plain Adam is not warned at its first logging step; a lost run is
warned before its loss leaves the chart; the attention collapse of Wortsman et al.
2023 is warned, naming the layer, also while its logits are in the hundreds, and its
qk-layernorm twin is not. Each run is a recipe of the
benchmark (its model, data, optimizer, schedule, z-loss; the clip is the Trainer's
``gradient_clip_val``), seconds on a CPU."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_hooks import AlarmRules, GradFlowCallback

from conftest import fit_alarms, load_benchmark, read_scalars


class Recipe(pl.LightningModule):
    """A run of ``benchmarks/divergence.py`` (``Run(**fields)``) for its first ``batches``
    steps (its schedule is the run's own, over ``Run.steps``)."""

    def __init__(self, batches: int, **fields: Any) -> None:
        super().__init__()
        bench = load_benchmark("divergence")
        self.run = bench.Run(**fields)
        torch.manual_seed(self.run.seed)
        self.net = bench.BUILD[self.run.model]()
        stream = bench._batches(self.run, torch.Generator().manual_seed(self.run.seed))
        self.batches = [next(stream) for _ in range(batches)]
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x).flatten(0, -2)
        loss = nn.functional.cross_entropy(logits, y.flatten())
        if self.run.zloss:
            loss = loss + self.run.zloss * torch.logsumexp(logits, -1).square().mean()
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self) -> Any:
        opt = load_benchmark("divergence")._optimizer(self.run, self.net)
        base = self.run.lr
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: self.run.lr_at(s) / base)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.batches, batch_size=None)  # type: ignore[arg-type]


def _fit(
    tmp_path: Path,
    model: Recipe,
    rules: AlarmRules | None = None,
    on_alarm: Any = "warn",
    **trainer: Any,
) -> list[Any]:
    """The alarms ``GradFlowCallback()`` (or with ``rules``, ``on_alarm``) warned in one epoch
    of ``model``."""
    callback = GradFlowCallback(alarms=rules or AlarmRules(), on_alarm=on_alarm)
    fit = pl.Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        accelerator="cpu",
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        gradient_clip_val=model.run.clip,
        **trainer,
    )
    return [w.message.alarm for w in fit_alarms(fit, model)]  # type: ignore[attr-defined]


def test_a_healthy_byte_transformer_on_plain_adam_is_not_warned(tmp_path: Path) -> None:
    """A byte-level post-LN transformer on Adam at 0.03, no warm-up: Adam's update per unit of
    LR falls more than 100x from its first step by the first logging step (the early gradients
    fill the second moment), while the loss keeps falling. Not a stall: nothing is warned.
    Without the loss's progress (``stall_progress=1``), and with the stall warning
    (``on_alarm={"stall": "warn"}``), it was."""
    fields = {"model": "byte-post-ln", "optimizer": "adam", "lr": 0.03, "seed": 0}
    model = Recipe(60, **fields)
    assert _fit(tmp_path / "now", model) == []
    assert model.losses[-1] < 0.7 * model.losses[0]  # it learns
    before = _fit(
        tmp_path / "before", Recipe(60, **fields), AlarmRules(stall_progress=1.0), {"stall": "warn"}
    )
    assert [(a.rule, a.step) for a in before] == [("stall", 49)]


_GPT = {"optimizer": "adamw95", "schedule": "cosine", "clip": 1.0, "zloss": 1e-4, "steps": 600}


def _collapse(tmp_path: Path, model: str) -> tuple[list[Any], dict[str, Any], Recipe]:
    """150 steps of the attention family at LR 0.3 (its 600-step schedule), logging every 25."""
    recipe = Recipe(150, model=model, lr=0.3, seed=0, **_GPT)
    alarms = _fit(tmp_path, recipe, log_every_n_steps=25)
    return alarms, read_scalars(tmp_path), recipe


def test_an_attention_collapse_is_warned_naming_the_layer(tmp_path: Path) -> None:
    """A byte-level GPT without qk-layernorm at LR 0.3: its attention logits grow and a head's
    attention becomes one-hot. ``attention`` warns at a logging step, names the layer and gives
    the fixes; the values it read are the logged ``stability/*_step`` ones."""
    alarms, scalars, _ = _collapse(tmp_path, "gpt")
    found = [a for a in alarms if a.rule == "attention"]
    assert found, [(a.rule, a.step) for a in alarms]
    first = found[0]
    assert first.layer.startswith("net.blocks.") and first.layer.endswith(".attn")
    assert first.step < 150 and (first.step + 1) % 25 == 0
    for fix in ("qk-layernorm", "lower the learning rate", "cap the attention logits"):
        assert fix in first.message
    logged = dict(scalars[f"stability/attn_logit_max_step/{first.layer}"])
    assert math.isclose(logged[first.step], first.value, rel_tol=1e-6)
    assert first.value > AlarmRules().attn_logit_max  # type: ignore[operator]
    entropy = dict(scalars[f"stability/attn_entropy_min_step/{first.layer}"])
    assert entropy[first.step] < AlarmRules().attn_entropy_min


def test_its_qk_layernorm_twin_is_not_warned(tmp_path: Path) -> None:
    """The same GPT with qk-layernorm: its logits stay small, nothing is warned."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        alarms, scalars, recipe = _collapse(tmp_path, "gpt-qk")
    assert alarms == []
    peaks = [v for tag, rows in scalars.items() if "attn_logit_max_step" in tag for _, v in rows]
    assert peaks and max(peaks) < 100.0
    assert recipe.losses[-1] < 0.6 * recipe.losses[0]


def test_one_collapsed_layer_of_two_is_not_warned(tmp_path: Path) -> None:
    """The same GPT at LR 0.1 (its qk-layernorm twin is no better, in the benchmark): by step
    199 one of its two attention layers has collapsed (logit over 1e3, entropy under 0.1 nats),
    the other has not. Not warned: a collapse needs ``attn_min_layers=2`` layers. With
    ``attn_min_layers=1`` (one layer suffices) it is, naming that layer, at a logging step."""
    recipe = Recipe(200, model="gpt", lr=0.1, seed=0, **_GPT)
    assert _fit(tmp_path / "now", recipe, log_every_n_steps=50) == []
    scalars = read_scalars(tmp_path / "now")
    peaks = {
        tag.rsplit("/", 1)[1]: dict(rows)[199]
        for tag, rows in scalars.items()
        if tag.startswith("stability/attn_logit_max_step/")
    }
    assert len(peaks) == 2 and sum(p > 1e3 for p in peaks.values()) == 1, peaks
    one = Recipe(200, model="gpt", lr=0.1, seed=0, **_GPT)
    found = _fit(tmp_path / "one", one, AlarmRules(attn_min_layers=1), log_every_n_steps=50)
    assert [a.rule for a in found] == ["attention"] and (found[0].step + 1) % 50 == 0  # logging
    assert peaks[found[0].layer] > 1e3  # the layer that collapses alone


def test_a_lost_run_is_warned_before_its_loss_leaves_the_chart(tmp_path: Path) -> None:
    """An MLP on SGD with momentum at LR 1: its loss climbs past 10x its start and never comes
    back. *diverging* warns before that step."""
    model = Recipe(20, model="mlp", optimizer="sgd", lr=1.0, seed=1)
    alarms = _fit(tmp_path, model)
    off = next(i for i, x in enumerate(model.losses) if not x < 10 * model.losses[0])
    assert [a.rule for a in alarms][:1] == ["diverging"] and alarms[0].step < off


def test_a_collapse_with_logits_in_the_hundreds_is_warned(tmp_path: Path) -> None:
    """A 3-layer GPT with heads of 32 at LR 0.03, no warm-up: by step 149 a layer's largest
    logit has grown about 1.5x per logging step to a few hundred, its heads one-hot; the run
    ends worse than its qk-layernorm twin. *attention* warns at step 149, naming that layer,
    with its logit under 1e3; the twin is not warned."""
    fields = {"lr": 0.03, "seed": 0, **_GPT, "schedule": "constant", "steps": 400}
    alarms = _fit(
        tmp_path / "gpt", Recipe(150, model="gpt-h32-deep", **fields), log_every_n_steps=50
    )
    found = [a for a in alarms if a.rule == "attention"]
    assert found and found[0].step == 149 and found[0].value < 1e3, [
        (a.rule, a.step) for a in alarms
    ]
    assert found[0].layer.endswith(".attn") and "qk-layernorm" in found[0].message
    twin = _fit(
        tmp_path / "qk", Recipe(150, model="gpt-h32-deep-qk", **fields), log_every_n_steps=50
    )
    assert twin == []
