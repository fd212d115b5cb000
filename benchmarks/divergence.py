"""The early warning judged on real divergence: learning-rate sweeps on real data, every rule set
replayed on the same recorded traces, this library's and its peers'.

Data that ships with installed packages, nothing downloaded: scikit-learn's ``load_digits``
(8x8 images, 10 classes) for an MLP, a 6-layer MLP and a CNN with BatchNorm; its
``load_breast_cancer`` for a residual MLP; the source text of Python's own ``argparse`` module
for a character-level LSTM and tiny pre-LN and post-LN transformers. Each run is 300 optimizer
steps, several seeds: a sweep (SGD or Adam, a constant LR or a linear ramp past what the model
can take), recipes (AdamW with warm-up and cosine decay to 0, RMSprop, SGD with Nesterov and
one-cycle, clipping on and off) and the families of ``benchmarks/families.py`` (byte-level
transformers and GPTs, recurrent models, transients, small batches and fine-tuning).

Each step records what the every-step check reads (per-layer gradient L2 norms and the global one,
before clipping and the optimizer step), the training loss, the LR and the typical update (what the
*stall* rule reads on logging steps), into one trace file (``--traces``); the rules are then
replayed on the traces: ours through the real :class:`~lightning_hooks.core.TrainingAlarms`, the
peers' re-implemented from their published sources at their defaults (see :data:`PEERS`).

Ground truth, from the loss alone (:func:`divergence_step`): a run diverges at the first step
where the loss is not finite, or where the mean loss of the last 5 steps is at least twice its
best so far *and* has given back at least half of what it had learnt (best vs the first step's
loss), unless the run ends below half its first loss (a transient it recovered from). A run that
never does is healthy.

One-step gradient explosions (:data:`EXPLOSIONS`: the gradient multiplied by 10, 1e3 or 1e6
after the backward, at step 37 or 150) are judged against their twin, the same run without the
event (:func:`damaging`): damaging when the loss 50 to 100 steps later is clearly above the
twin's (1.25x it plus 2% of the twin's first loss, a margin in the loss's own scale), else
harmless.

A second label, from how a run ends (:func:`harmed`): a run is *harmed* when the mean of its
last 50 training losses is above ``max(1.10 x best, best + 0.05)``, ``best`` the lowest such mean
of its family (:func:`recipe`: the same model, so the same data, optimizer, schedule, clipping,
z-loss, length, batch and accumulation, at any learning rate or seed, without an injected event).
A warning on a run neither harmed nor divergent is false by it. Both labels are reported, with
the precision of every rule set (of its warned runs, the share harmed or divergent) per half
(:func:`label_halves`), and the warned runs the old label calls healthy.

Three families more, replayed in tables of their own (:func:`new_families`, the defaults'
alarms as ``GradFlowCallback`` acts on them: notices, warnings, and the stops of
``on_alarm="stop"``): networks a too-high learning rate kills (:data:`DEAD`: small ReLU MLPs
and CNNs on the digits and the breast-cancer set, Adam 0.03-1 and SGD with momentum 0.5-10,
with healthy twins), the step of death taken from the recorded activations (:func:`death`: a
ReLU layer none of whose units fires again); healthy runs whose layers idle (:data:`IDLING`: a
frozen backbone, an unused branch, a mixture of experts); healthy runs with one outlier batch
(:data:`OUTLIERS`: a step's loss x10 or x30, or one or two steps of labels shifted by one
class), each with its twin. Their held-out half (:data:`NEW_HELD_OUT`) was frozen when they were
recorded, before any rule was tuned on them. Two outlier families on SGD with momentum tune the
rule for an outlier's echo; quick fresh families of new models, data and recipes
(:data:`FRESH_LRS`, :data:`NEW_FRESH`) were frozen and recorded before it was judged on them.
A second fresh half (:data:`FRESH2_LRS`: new models on the iris, synthetic, diabetes, digits,
breast-cancer and wine sets, on Adam, AdamW, SGD with momentum or Nesterov, RMSprop and
Adagrad, with constant, warm-up, step, cosine, one-cycle and linear schedules) was frozen and
recorded before the change to the loss rule that it judges, and is reported apart (``fresh2``).

The traces are saved in ``benchmarks/results/divergence_traces.pt`` (``--traces``; not in git).
Recording every run takes roughly an hour of one CPU core (estimated from a few steps of each),
most of it the byte-level models, GPTs and fine-tunes; ``--quick`` records only the missing
runs of :data:`QUICK` (the digits, tabular and character-level models and the new families:
about 8 minutes of one core) and replays the traces there are. Replaying every rule set on the
quick runs takes under a minute. When some run of the main replay has no trace, its tables are
kept from the saved result and only the sections of :func:`new_markdown` are written again.

Usage::

    PYTHONPATH=$PWD python benchmarks/divergence.py            # record (if needed) and replay
    PYTHONPATH=$PWD python benchmarks/divergence.py --record   # record the traces again
    PYTHONPATH=$PWD python benchmarks/divergence.py --quick    # the quick runs only
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from functools import cache, partial
from pathlib import Path
from typing import Any, NamedTuple

import families
import numpy as np
import torch
from torch import nn

from lightning_hooks.callbacks.alarm_actions import check_actions
from lightning_hooks.core import AlarmRules, ParamLayout, TrainingAlarms
from lightning_hooks.core.alarms import ALARM_RULES, RunFacts, TrainingAlarm
from lightning_hooks.core.ops.grad_stats import param_norms, segment_norm
from lightning_hooks.core.ops.grouped_norms import typical_update
from lightning_hooks.core.stats.stability import StabilityStats
from lightning_hooks.tags import NOTICES

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STEPS = 300
SMOOTH = 5  # steps in the ground truth's mean loss
SEEDS = (0, 1, 2)
HELD_OUT = (2,)  # seeds not looked at while the defaults were chosen
ADAPTIVE = ("adam", "adamw", "rmsprop", "adamw95", "adagrad")  # with a second moment
LOG_EVERY = 50  # the Trainer's log_every_n_steps: the callback's logging steps
DAMAGE_WINDOW = (50, 100)  # steps after an explosion where its loss is compared with the twin's
# "clearly worse": this ratio, and above it by this share of the twin's first loss (the loss's
# scale: 0.046 on the 10-class sets, whose first loss is ln 10; 0.014 on a 2-class one)
DAMAGE_RATIO, DAMAGE_MARGIN = 1.25, 0.02
_SEQ, _VOCAB = 32, 96
WARNED = tuple(
    rule for rule, action in check_actions("warn", "GradFlowCallback").items() if action == "warn"
)
"""The rules that warn under the default ``on_alarm="warn"``."""

# --- data -------------------------------------------------------------------------------------


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    return x, torch.tensor(data.target, dtype=torch.long)


def _cancer() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's ``load_breast_cancer`` (30 features, 2 classes), standardised."""
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    return x, torch.tensor(data.target, dtype=torch.long)


def _wine() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's ``load_wine`` (13 features, 3 classes), standardised."""
    from sklearn.datasets import load_wine

    data = load_wine()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    return x, torch.tensor(data.target, dtype=torch.long)


def _standardised(x: Any) -> torch.Tensor:
    """Features as a float tensor, each column standardised."""
    t = torch.tensor(x, dtype=torch.float32)
    return (t - t.mean(0)) / t.std(0)


def _iris() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's ``load_iris`` (4 features, 3 classes), standardised."""
    from sklearn.datasets import load_iris

    data = load_iris()
    return _standardised(data.data), torch.tensor(data.target, dtype=torch.long)


def _synth() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's ``make_classification``: 1000 rows, 20 features (10 informative), 4
    classes, a fixed ``random_state``; standardised."""
    from sklearn.datasets import make_classification

    x, y = make_classification(
        n_samples=1000, n_features=20, n_informative=10, n_classes=4, random_state=0
    )
    return _standardised(x), torch.tensor(y, dtype=torch.long)


def _diabetes() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's ``load_diabetes`` (10 features) as classification: its regression target
    binned at its quartiles into 4 classes; standardised."""
    from sklearn.datasets import load_diabetes

    data = load_diabetes()
    edges = np.quantile(data.target, [0.25, 0.5, 0.75])
    return _standardised(data.data), torch.tensor(np.digitize(data.target, edges))


def _text() -> torch.Tensor:
    """``argparse``'s source as printable-ASCII codes (0-95: the rest maps to 0)."""
    source = Path(argparse.__file__).read_text(encoding="utf-8")
    codes = [min(max(ord(c) - 31, 0), _VOCAB - 1) if c != "\n" else 0 for c in source]
    return torch.tensor(codes, dtype=torch.long)


# --- models -----------------------------------------------------------------------------------


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    )  # fmt: skip


def _mlp6() -> nn.Module:
    """A 6-layer MLP on the digits."""
    layers: list[nn.Module] = []
    for _ in range(5):
        layers += [nn.Linear(64, 64), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(64, 10))


_BASES: dict[str, dict[str, torch.Tensor]] = {}


def _pretrained(kind: str = "gpt") -> nn.Module:
    """The fine-tunes' base: a byte-level GPT (2 layers, d 64; ``kind="gpt"``) or GRU
    (``kind="gru"``) trained 300 steps on its family's text (``argparse``'s source, and
    ``inspect``'s) on AdamW 3e-3 with warm-up, cosine decay and clipping at 1, seed 0; once per
    process."""
    if kind not in _BASES:
        rng = torch.get_rng_state()
        for model, *_ in train(Run(kind, "adamw", 3e-3, "cosine", clip=1.0)):
            trained = model
        _BASES[kind] = trained.state_dict()
        torch.set_rng_state(rng)
    model = families.GPT(qk_norm=False) if kind == "gpt" else families.ByteGRU()
    model.load_state_dict(_BASES[kind])
    return model


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip


class _LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(_VOCAB, 32)
        self.lstm = nn.LSTM(32, 64, batch_first=True)
        self.head = nn.Linear(64, _VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(x))[0])  # type: ignore[no-any-return]


class _Transformer(nn.Module):
    def __init__(self, pre_ln: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(_VOCAB, 32)
        self.pos = nn.Embedding(_SEQ, 32)
        layer = nn.TransformerEncoderLayer(
            32, 4, 64, dropout=0.0, batch_first=True, norm_first=pre_ln
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, _VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(_SEQ))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos.weight[: x.shape[1]]
        return self.head(self.encoder(h, mask=self.mask, is_causal=True))  # type: ignore[no-any-return]


BUILD: dict[str, Callable[[], nn.Module]] = {
    "mlp": _mlp,
    "mlp6": _mlp6,
    "resmlp": lambda: families.ResMLP(30, 2),
    "cnn": _cnn,
    "lstm": _LSTM,
    "pre-ln": lambda: _Transformer(pre_ln=True),
    "post-ln": lambda: _Transformer(pre_ln=False),
    # the families of benchmarks/families.py
    "byte-pre-ln": lambda: families.ByteTransformer(pre_ln=True),
    "byte-post-ln": lambda: families.ByteTransformer(pre_ln=False),
    "gru": families.ByteGRU,
    "gpt": lambda: families.GPT(qk_norm=False),
    "gpt-qk": lambda: families.GPT(qk_norm=True),
    "gpt-wide": lambda: families.GPT(qk_norm=False, d=80, layers=3),
    "gpt-wide-qk": lambda: families.GPT(qk_norm=True, d=80, layers=3),
    "gpt-deep": lambda: families.GPT(qk_norm=False, layers=4),
    "gpt-deep-qk": lambda: families.GPT(qk_norm=True, layers=4),
    "gpt-6h": lambda: families.GPT(qk_norm=False, d=96, layers=3),
    "gpt-6h-qk": lambda: families.GPT(qk_norm=True, d=96, layers=3),
    # the families of transients, collapses with logits in the hundreds and small batches
    "cnn-m": _cnn,
    "bnmlp": families.BNMLP,
    "gru2": lambda: families.ByteGRU(layers=2),
    "lstm2": families.ByteLSTM,
    "resmlp-digits": lambda: families.ResMLP(64, 10),
    "resmlp-wine": lambda: families.ResMLP(13, 3),
    "gpt-h32": lambda: families.GPT(qk_norm=False, head=32),
    "gpt-h32-qk": lambda: families.GPT(qk_norm=True, head=32),
    "gpt-h32-deep": lambda: families.GPT(qk_norm=False, layers=3, head=32),
    "gpt-h32-deep-qk": lambda: families.GPT(qk_norm=True, layers=3, head=32),
    "wine": families.Tabular,
    "ft": _pretrained,
    "ft-lora": lambda: families.LoRA(_pretrained()),  # type: ignore[arg-type]
    "ft-mix": _pretrained,
    "ft-mix-lora": lambda: families.LoRA(_pretrained()),  # type: ignore[arg-type]
    "ft-gru-mix": lambda: _pretrained("gru"),
    # networks a too-high learning rate kills, and their healthy twins (:data:`DEAD`)
    "relu-mlp-digits": lambda: families.ReluMLP(64, 10),
    "relu-cnn-digits": families.ReluCNN2d,
    "relu-mlp-cancer": lambda: families.ReluMLP(30, 2),
    "relu-cnn-cancer": families.ReluCNN1d,
    # healthy runs whose layers idle a while (:data:`IDLING`)
    "frozen-digits": lambda: families.FrozenBackbone(64, 10),
    "frozen-cancer": lambda: families.FrozenBackbone(30, 2),
    "branch-digits": lambda: families.TwoBranch(64, 10),
    "branch-cancer": lambda: families.TwoBranch(30, 2),
    "moe-digits": lambda: families.MixtureOfExperts(64, 10),
    "moe-cancer": lambda: families.MixtureOfExperts(30, 2),
    # healthy runs with one outlier batch (:data:`OUTLIERS`)
    "outlier-mlp-cancer": lambda: families.ReluMLP(30, 2),
    "outlier-mlp-digits": _mlp,
    "outlier-wine": families.Tabular,
    "outlier-cnn-digits": _cnn,
    "outlier-bnmlp-cancer": lambda: families.BNMLP(30, 2),
    "outlier-bncnn-cancer": families.BNCNN1d,
    "outlier-pool-cnn-digits": families.PoolCNN2d,
    "outlier-bnmlp-wine": lambda: families.BNMLP(13, 3),
    "outlier-tanh-digits": lambda: families.DeepMLP(64, 10, layers=3, activation=nn.Tanh),
    "outlier-gelu-cancer": lambda: families.DeepMLP(30, 2, layers=4, activation=nn.GELU),
    # fresh families, recorded after the defaults were frozen (:data:`FRESH_MODELS`)
    "fresh-mlp6-wine": lambda: families.DeepMLP(13, 3),
    "fresh-tanh-digits": lambda: families.DeepMLP(64, 10, layers=3, activation=nn.Tanh),
    "fresh-gelu-cancer": lambda: families.DeepMLP(30, 2, layers=4, activation=nn.GELU),
    "fresh-wide-digits": lambda: families.DeepMLP(64, 10, layers=3, width=256),
    "fresh-pool-cnn-digits": families.PoolCNN2d,
    "fresh-bnmlp-wine": lambda: families.BNMLP(13, 3),
    # the second fresh half, frozen before the rule change it judges (:data:`FRESH2_MODELS`)
    "fresh2-silu-iris": lambda: families.DeepMLP(4, 3, layers=3, width=32, activation=nn.SiLU),
    "fresh2-lnmlp-synth": lambda: families.LNMLP(20, 4),
    "fresh2-tanh-diabetes": lambda: families.DeepMLP(10, 4, layers=4, activation=nn.Tanh),
    "fresh2-resmlp-synth": lambda: families.ResMLP(20, 4, d=48, blocks=4),
    "fresh2-gncnn-digits": families.GNCNN2d,
    "fresh2-elu-cancer": lambda: families.DeepMLP(30, 2, layers=5, width=48, activation=nn.ELU),
    "fresh2-leaky-wine": lambda: families.DeepMLP(
        13, 3, layers=4, width=128, activation=nn.LeakyReLU
    ),
    "fresh2-bnmlp-diabetes": lambda: families.BNMLP(10, 4),
}
MIXED = ("ft-mix", "ft-mix-lora", "ft-gru-mix")
"""The fine-tunes on :data:`families.MIXED_DOCS`: each micro-batch from one document."""
BYTE_TEXT = {
    "byte-pre-ln": "argparse", "byte-post-ln": "inspect", "gru": "inspect", "gru2": "typing",
    "lstm2": "tarfile", "ft": "inspect", "ft-lora": "typing",
}  # fmt: skip
GPT_TEXT = {
    "gpt": "argparse", "gpt-wide": "inspect", "gpt-deep": "typing", "gpt-6h": "tarfile",
    "gpt-h32": "inspect", "gpt-h32-deep": "argparse",
}  # fmt: skip
"""The text each byte-level model reads (a GPT's qk-layernorm twin: its own)."""


# --- the sweep --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One training run: model, optimizer, learning rate and its schedule, clipping, seed, and
    an injected one-step gradient explosion (the gradient times ``explode`` at ``explode_at``).
    """

    model: str
    optimizer: str  # sgd (momentum 0.9, 0 on the LSTM), nesterov, adam, adamw, rmsprop, adagrad
    lr: float
    # "ramp": linear from 0 to ``lr`` over the run; "cosine": 10% linear warm-up, then cosine
    # decay to 0 at the last step; "onecycle": torch's OneCycleLR (cosine, pct_start 0.3);
    # "step": x0.1 at half the run, x0.01 at three quarters; "linear": 10% linear warm-up, then
    # linear decay to 0; "warmup": 10% linear warm-up, then constant
    schedule: str = "constant"
    seed: int = 0
    clip: float | None = None  # clip_grad_norm_ before the step
    explode_at: int | None = None
    explode: float = 1.0
    steps: int = STEPS
    zloss: float = 0.0  # z-loss: this times the mean squared log-partition of the output logits
    batch: int | None = None  # examples per micro-batch (None: 32 rows, 16 windows of text)
    accum: int = 1  # micro-batches per optimizer step (``accumulate_grad_batches``)
    outlier_at: int | None = None  # the optimizer step of an injected outlier batch
    outlier: float = 1.0  # that step's loss times this (its gradient is the scaled loss's)
    shifted: int = 0  # steps from ``outlier_at`` whose labels are shifted by one class

    @property
    def name(self) -> str:
        sched = "" if self.schedule == "constant" else f", {self.schedule}"
        clip = "" if self.clip is None else f", clip {self.clip:g}"
        boom = "" if self.explode_at is None else f", x{self.explode:g} at {self.explode_at}"
        zloss = "" if not self.zloss else f", z-loss {self.zloss:g}"
        steps = "" if self.steps == STEPS else f", {self.steps} steps"
        batch = "" if self.batch is None else f", batch {self.batch}"
        accum = "" if self.accum == 1 else f" x {self.accum}"
        odd = ""
        if self.outlier_at is not None:
            scaled = [f"loss x{self.outlier:g}"] if self.outlier != 1.0 else []
            wrong = [f"labels+1 x{self.shifted}"] if self.shifted else []
            odd = f", {' and '.join([*scaled, *wrong])} at {self.outlier_at}"
        return (
            f"{self.model}, {self.optimizer} {self.lr:g}{sched}{clip}{zloss}{steps}{batch}"
            f"{accum}{boom}{odd}"
        )

    @property
    def twin(self) -> Run:
        """The same run without the explosion."""
        return replace(self, explode_at=None, explode=1.0)

    @property
    def clean(self) -> Run:
        """The same run without the outlier batch."""
        return replace(self, outlier_at=None, outlier=1.0, shifted=0)

    def outlier_step(self, step: int) -> bool:
        """Whether optimizer step ``step`` reads an injected outlier batch."""
        at = self.outlier_at
        return at is not None and at <= step < at + max(self.shifted, 1)

    def lr_at(self, step: int) -> float:  # noqa: PLR0911 (one return per schedule)
        """The learning rate of optimizer step ``step``."""
        last = self.steps - 1
        t = step / last
        if self.schedule == "step":  # x0.1 at half the run, x0.01 at three quarters
            return self.lr * (1.0 if t < 0.5 else 0.1 if t < 0.75 else 0.01)
        warm = self.steps // 10
        if self.schedule in ("linear", "cosine", "warmup") and step < warm:
            return self.lr * (step + 1) / warm
        if self.schedule == "linear":
            return self.lr * (last - step) / (last - warm)
        if self.schedule == "ramp":
            return self.lr * (step + 1) / self.steps
        if self.schedule == "cosine":
            return self.lr * 0.5 * (1.0 + math.cos(math.pi * (step - warm) / (last - warm)))
        if self.schedule == "onecycle":
            start, end = self.lr / 25.0, self.lr / 25.0 / 1e4
            if t <= 0.3:
                return start + (self.lr - start) * 0.5 * (1.0 - math.cos(math.pi * t / 0.3))
            return end + (self.lr - end) * 0.5 * (1.0 + math.cos(math.pi * (t - 0.3) / 0.7))
        return self.lr


SWEEP = [
    *(Run("mlp", "sgd", lr) for lr in (0.1, 1.0, 3.0)),
    *(Run("mlp", "adam", lr) for lr in (1e-3, 1e-2, 0.1)),
    Run("mlp", "adam", 0.3, "ramp"),
    *(Run("cnn", "sgd", lr) for lr in (0.1, 3.0)),
    *(Run("cnn", "adam", lr) for lr in (3e-3, 0.1, 1.0)),
    *(Run("lstm", "sgd", lr) for lr in (1.0, 30.0)),
    *(Run("lstm", "adam", lr) for lr in (3e-3, 0.1)),
    *(Run("pre-ln", "adam", lr) for lr in (1e-3, 3e-2)),
    Run("pre-ln", "adam", 0.3, "ramp"),
    *(Run("post-ln", "adam", lr) for lr in (1e-3, 3e-2)),
    Run("post-ln", "adam", 0.3, "ramp"),
]
"""The sweep: SGD and Adam, constant or a ramp, no clipping."""

# The twins of the explosions (healthy recipes, with and without clipping), and recipes that
# users run beyond SGD and Adam: AdamW with warm-up and cosine decay to 0, RMSprop, SGD with
# Nesterov and one-cycle; a recurrent model on RMSprop with clipping; a residual model on
# another data set.
_RECIPES = [("adam", 1e-3, "constant"), ("adamw", 1e-3, "cosine"), ("sgd", 0.05, "constant")]
TWINS = [
    *(
        Run(model, opt, lr, sched, clip=clip)
        for model in ("mlp6", "resmlp")
        for opt, lr, sched in (*_RECIPES, ("rmsprop", 1e-3, "constant"))
        for clip in (None, 1.0)
    ),
]
RECIPES = [
    *TWINS,
    Run("mlp6", "adamw", 0.1, "cosine"),
    Run("mlp6", "rmsprop", 0.03),
    Run("mlp6", "nesterov", 0.3, "onecycle"),
    Run("mlp6", "nesterov", 10.0, "onecycle"),
    *(Run("lstm", "rmsprop", lr, clip=1.0) for lr in (3e-3, 1e-2, 0.1)),
    Run("lstm", "adamw", 3e-3, "cosine", clip=1.0),
    Run("resmlp", "adamw", 0.3, "cosine"),
    Run("resmlp", "nesterov", 1.0, "onecycle", clip=1.0),
    Run("resmlp", "rmsprop", 0.1),
]
EXPLODE_SIZES = (10.0, 1e3, 1e6)
EXPLODE_AT = {0: 37, 1: 150}  # by seed: an early step, and one later in the run
EXPLOSIONS = [
    replace(twin, explode_at=-1, explode=size)  # explode_at: set from the seed when recorded
    for twin in TWINS
    if twin.model == "mlp6" or twin.optimizer in ("adam", "rmsprop")
    for size in EXPLODE_SIZES
]
"""One-step gradient explosions: every recipe of the 6-layer MLP, Adam and RMSprop on the
residual model, with and without clipping, three sizes; on seeds 0 and 1."""


# Families users run beyond the sweep and the recipes (benchmarks/families.py).
_GPT = {"optimizer": "adamw95", "schedule": "cosine", "clip": 1.0, "zloss": 1e-4, "steps": 600}
ATTENTION_LRS = (1e-2, 3e-2, 0.1, 0.3)
UNSEEN = [
    *(
        Run(model, "adam", lr)
        for model in ("byte-pre-ln", "byte-post-ln")
        for lr in (1e-3, 1e-2, 3e-2, 0.1)
    ),
    *(Run("gru", "rmsprop", lr, clip=5.0) for lr in (3e-3, 1e-2, 3e-2, 0.1)),
    *(Run("cnn", "nesterov", lr, steps=600) for lr in (0.1, 0.3)),
]
"""Byte-level transformers on plain Adam, a GRU on RMSprop with clipping, a BatchNorm CNN whose
loss goes to about 0 over a long run; on every seed."""
ATTENTION = [
    Run(model, lr=lr, **_GPT)  # type: ignore[arg-type]
    for base in GPT_TEXT
    for model in (base, f"{base}-qk")
    for lr in ATTENTION_LRS
]
"""The attention-instability family: each GPT without qk-layernorm and its qk-layernorm twin."""
LOGITS = [replace(run, zloss=0.0) for run in ATTENTION if run.model == "gpt-qk" and run.lr >= 0.1]
"""The output-logit family: the qk-layernorm GPT without z-loss (its twin, with z-loss 1e-4, is
in :data:`ATTENTION`)."""
ATTENTION_SEEDS = (0,)

_H32 = {**_GPT, "schedule": "constant", "steps": 400}
TRANSIENTS = [
    *(Run("cnn-m", "sgd", lr) for lr in (0.5, 1.0, 2.0)),
    *(Run("bnmlp", "sgd", lr) for lr in (0.5, 1.0, 2.0)),
    *(Run(model, "rmsprop", lr, clip=5.0) for model in ("gru2", "lstm2") for lr in (1e-2, 3e-2)),
    *(Run("resmlp", "adam", lr, "step") for lr in (1e-2, 3e-2, 0.1)),
    *(Run("resmlp-digits", "adam", lr, "step") for lr in (1e-2, 3e-2, 0.1)),
]
"""Early transients under SGD with momentum (a BatchNorm CNN and MLP), RMSprop on two-layer
recurrent models with clipping, Adam on residual MLPs with LayerNorm and a step schedule."""
COLLAPSES = [
    Run(model, lr=lr, **_H32)  # type: ignore[arg-type]
    for base in ("gpt-h32", "gpt-h32-deep")
    for model in (base, f"{base}-qk")
    for lr in (3e-2, 4e-2, 5e-2)
]
"""Attention collapse at learning rates where the logit grows through the hundreds: GPTs with
heads of 32 at a constant rate without warm-up, each with its qk-layernorm twin."""
FINE_TUNING = [
    *(Run("wine", "sgd", lr, batch=2) for lr in (3e-3, 1e-2, 3e-2)),
    *(Run("wine", "adam", lr, batch=4) for lr in (1e-3, 3e-3, 1e-2)),
    Run("ft", "adamw", 3e-3, "linear", batch=2, accum=8),
    Run("ft", "adamw", 1e-3, "linear", batch=4),
    Run("ft", "adamw", 3e-4, "linear", batch=1, accum=4),
    Run("ft-lora", "adamw", 1e-2, "linear", batch=1, accum=4),
    Run("ft-lora", "adamw", 3e-3, "linear", batch=4),
    Run("ft-lora", "adamw", 3e-3, "linear", batch=2, accum=8),
]
"""Small-batch fine-tuning: a small tabular MLP with a batch of 2 on SGD with momentum or of 4
on Adam; a pretrained byte-level GPT (:func:`_pretrained`) fine-tuned on another text whole
or through low-rank adapters on the frozen base, micro-batches of 1-4 with and without
accumulation."""
_MIX_LRS = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
FINE_TUNING_MIXED = [
    *(Run("ft-mix", "adamw", lr, "linear", batch=1) for lr in _MIX_LRS),
    *(Run("ft-mix", "adamw", lr, "linear", batch=2, accum=8) for lr in _MIX_LRS),
    *(Run("ft-mix-lora", "adamw", lr, "linear", batch=1) for lr in (3e-3, 1e-2, 3e-2, 0.1)),
    *(Run("ft-mix-lora", "adamw", lr, "linear", batch=2, accum=8) for lr in (3e-3, 3e-2, 0.1)),
]
"""Fine-tuning on documents that differ a lot in difficulty (:data:`MIXED`): the pretrained
GPT whole at a micro-batch of 1, and of 2 with ``accumulate_grad_batches=8``, and through
low-rank adapters on its frozen base; learning rates from gentle to past what it can take."""
NEW_SEEDS = (0, 1)
FRESH_RUNS = [
    *(Run("resmlp-wine", "adam", lr, "step", batch=4) for lr in (1e-2, 3e-2, 0.1)),
    *(Run("ft-gru-mix", "adamw", lr, "linear", batch=1) for lr in (1e-3, 3e-3, 1e-2, 3e-2)),
    *(Run("ft-gru-mix", "adamw", lr, "linear", batch=2, accum=8) for lr in (1e-3, 1e-2)),
]
FRESH_LRS = {
    "fresh-mlp6-wine": ("adam", "constant", 16, (1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)),
    "fresh-tanh-digits": ("rmsprop", "constant", 64, (1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3)),
    "fresh-gelu-cancer": ("adamw", "cosine", None, (1e-3, 1e-2, 0.1, 0.3, 1.0, 3.0)),
    "fresh-wide-digits": ("nesterov", "onecycle", None, (0.03, 0.3, 1.0, 3.0, 10.0, 30.0)),
    "fresh-pool-cnn-digits": ("adam", "step", None, (1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)),
    "fresh-bnmlp-wine": ("sgd", "constant", 16, (0.01, 0.1, 0.5, 1.0, 3.0, 10.0)),
}  # fmt: skip
"""The fresh families of quick models: per model, its optimizer, schedule, batch (``None``:
32) and learning rates, from a usual one to past what the model can take."""
FRESH_MODELS = frozenset(FRESH_LRS)
FRESH_RUNS += [
    Run(model, optimizer, lr, schedule, batch=batch)
    for model, (optimizer, schedule, batch, lrs) in FRESH_LRS.items()
    for lr in lrs
]
"""Recorded after the defaults were frozen: a residual MLP with LayerNorm on the wine set, a
batch of 4, Adam with a step schedule (transients and small noisy batches at once); a
pretrained byte GRU fine-tuned whole on the documents of :data:`MIXED` at a micro-batch of 1,
and of 2 with accumulation over 8. Then the quick families of :data:`FRESH_LRS`, new models,
data and recipes, frozen with the rule's change for outlier batches under SGD with momentum
and recorded before it was judged on them: a 6-layer ReLU MLP on the wine set at a batch of 16
on Adam; a 3-layer tanh MLP on the digits at 64 on RMSprop; a 4-layer GELU MLP on the
breast-cancer set on AdamW with warm-up and cosine decay; a wide (256) ReLU MLP on the digits on
SGD with Nesterov and one-cycle; a CNN with max pooling on the digits on Adam with a step
schedule; an MLP with BatchNorm on the wine set at 16 on SGD with momentum 0.9."""


class FreshRecipe(NamedTuple):
    """How a family of the second fresh half trains: its optimizer, schedule, batch (``None``:
    32), clipping (``None``: off) and the learning rates of its sweep."""

    optimizer: str
    schedule: str
    batch: int | None
    clip: float | None
    lrs: tuple[float, ...]


FRESH2_LRS = {
    "fresh2-silu-iris": FreshRecipe("adam", "warmup", 16, None, (1e-3, 1e-2, 0.1, 0.3, 1.0, 3.0)),
    "fresh2-lnmlp-synth": FreshRecipe("sgd", "step", None, None, (0.01, 0.1, 0.3, 1.0, 3.0, 10.0)),
    "fresh2-tanh-diabetes": FreshRecipe(
        "adagrad", "constant", None, None, (0.01, 0.1, 0.3, 1.0, 3.0, 10.0)
    ),
    "fresh2-resmlp-synth": FreshRecipe(
        "adamw", "onecycle", 64, None, (1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
    ),
    "fresh2-gncnn-digits": FreshRecipe(
        "rmsprop", "cosine", None, 1.0, (1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3)
    ),
    "fresh2-elu-cancer": FreshRecipe("adam", "step", 8, None, (1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)),
    "fresh2-leaky-wine": FreshRecipe(
        "nesterov", "onecycle", 8, None, (0.01, 0.1, 0.3, 1.0, 3.0, 10.0)
    ),
    "fresh2-bnmlp-diabetes": FreshRecipe(
        "sgd", "linear", 16, None, (0.01, 0.1, 0.5, 1.0, 3.0, 10.0)
    ),
}
"""The second fresh half: per model, how it trains, each swept from a usual learning rate to
past what the model can take."""
FRESH2_MODELS = frozenset(FRESH2_LRS)
FRESH2_RUNS = [
    Run(model, spec.optimizer, lr, spec.schedule, clip=spec.clip, batch=spec.batch)
    for model, spec in FRESH2_LRS.items()
    for lr in spec.lrs
]
"""Frozen and recorded before the change to the loss rule that it judges, and before any of
its results was looked at: new models, data and recipes beside every other half. A 3-layer SiLU
MLP on the iris set at a batch of 16 on Adam with a linear warm-up to a constant rate; an MLP
with LayerNorm and GELU on a synthetic 4-class set (``make_classification``) on SGD with
momentum 0.9 and a step schedule; a 4-layer tanh MLP on the diabetes set binned into quartiles
on Adagrad; a residual MLP of 4 pre-LN blocks on the synthetic set at 64 on AdamW with
one-cycle; a CNN with GroupNorm and SiLU on the digits on RMSprop with warm-up, cosine decay
and clipping at 1; a 5-layer ELU MLP on the breast-cancer set at 8 on Adam with a step
schedule; a wide (128) 4-layer LeakyReLU MLP on the wine set at 8 on SGD with Nesterov and
one-cycle; an MLP with BatchNorm on the binned diabetes set at 16 on SGD with momentum, warm-up
and linear decay."""

# Networks a too-high learning rate kills, healthy runs whose layers idle, healthy runs with an
# outlier batch: recorded, their held-out half frozen (NEW_HELD_OUT), before any rule was tuned
# on them.
DEAD_MODELS = ("relu-mlp-digits", "relu-cnn-digits", "relu-mlp-cancer", "relu-cnn-cancer")
DEAD_ADAM_LRS = (0.03, 0.1, 0.3, 1.0)
DEAD_SGD_LRS = (0.5, 1.0, 2.0, 5.0, 10.0)
DEAD_TWINS = (("adam", 1e-3), ("sgd", 0.05))
DEAD = [
    *(
        Run(model, opt, lr)
        for model in DEAD_MODELS
        for opt, lrs in (("adam", DEAD_ADAM_LRS), ("sgd", DEAD_SGD_LRS))
        for lr in lrs
    ),
    *(Run(model, opt, lr) for model in DEAD_MODELS for opt, lr in DEAD_TWINS),
]
"""Small ReLU networks without normalisation (an MLP and a CNN on the digits and on the
breast-cancer set, batch 32): Adam at 0.03-1 and SGD with momentum 0.9 at 0.5-10, where a ReLU
layer can die whole and the loss sit at chance; their healthy twins at Adam 1e-3 and SGD 0.05.
Ground truth: :func:`death`, from the recorded activations."""
IDLE_MODELS = (
    "frozen-digits", "frozen-cancer", "branch-digits", "branch-cancer", "moe-digits",
    "moe-cancer",
)  # fmt: skip
IDLING = [Run(model, opt, lr) for model in IDLE_MODELS for opt, lr in DEAD_TWINS]
"""Healthy runs where layers get no gradient for a while (:data:`families.IDLE`): a backbone
frozen for the first 200 steps (no gradient reaches it), a branch unused from step 100 (no
gradient), a mixture of experts whose experts 2 and 3 are not chosen over steps 100-200 (a
gradient of exactly 0: the experts run densely); Adam 1e-3 and SGD 0.05, batch 32."""
OUTLIER_AT = 120
OUTLIER_KINDS = ({"outlier": 10.0}, {"outlier": 30.0}, {"shifted": 1}, {"shifted": 2})
_OUTLIER_TWINS = [
    Run("outlier-mlp-cancer", "adamw", 3e-4, batch=2, accum=4),
    Run("outlier-mlp-digits", "adam", 1e-3),
    Run("outlier-wine", "adam", 1e-3, batch=4, accum=2),
    Run("outlier-cnn-digits", "sgd", 0.05),
    Run("outlier-bnmlp-cancer", "sgd", 0.05),
    Run("outlier-bncnn-cancer", "sgd", 0.05),
    *(
        Run(model, optimizer, lr, batch=batch, accum=accum)
        for model, (optimizer, lr, batch, accum) in {
            "outlier-pool-cnn-digits": ("sgd", 0.05, None, 1),
            "outlier-bnmlp-wine": ("sgd", 0.05, 16, 1),
            "outlier-tanh-digits": ("adam", 1e-3, 64, 1),
            "outlier-gelu-cancer": ("adamw", 3e-4, 2, 4),
        }.items()
    ),
]
OUTLIERS = [
    *_OUTLIER_TWINS,
    *(
        replace(twin, outlier_at=OUTLIER_AT, **kind)  # type: ignore[arg-type]
        for twin in _OUTLIER_TWINS
        for kind in OUTLIER_KINDS
    ),
]
"""Healthy runs with one outlier at step :data:`OUTLIER_AT`: every micro-batch of that step
reads 10x or 30x its loss (and back-propagates the scaled loss), or the labels of one or two
consecutive steps' batches are shifted by one class (``(y + 1) mod C``: a real loss and
gradient); each with its twin without the outlier. A breast-cancer MLP at a batch of 2 x 4
accumulated on AdamW 3e-4, a digits MLP at a batch of 32 on Adam 1e-3, the wine set's small
MLP at 4 x 2 on Adam 1e-3, the digits CNN with BatchNorm at 32 on SGD 0.05 with momentum; then
(added to the tuning half, so that a rule for SGD with momentum is tuned without the held-out
CNN) an MLP with BatchNorm and a 1-d CNN with BatchNorm on the breast-cancer set at 32 on SGD
0.05 with momentum 0.9; then four fresh families (:data:`FRESH_OUTLIER_MODELS`), recorded
before the rule for an outlier that the loss falls back from was judged on them: the digits CNN
with max pooling at 32 on SGD 0.05 with momentum, the wine set's MLP with BatchNorm at 16 on SGD
0.05 with momentum, a 3-layer tanh MLP on the digits at 64 on Adam 1e-3, and a 4-layer GELU MLP
on the breast-cancer set at 2 x 4 accumulated on AdamW 3e-4."""
FRESH_OUTLIER_MODELS = frozenset(
    {"outlier-pool-cnn-digits", "outlier-bnmlp-wine", "outlier-tanh-digits", "outlier-gelu-cancer"}
)
"""The outlier families of the fresh half: new models, data and recipes."""
NEW_MODELS = frozenset({*DEAD_MODELS, *IDLE_MODELS, *(r.model for r in _OUTLIER_TWINS)})
"""The models of the dead-network, idling and outlier families: replayed in their own tables
(:func:`main`), not in the main replay's."""

FAMILY = {
    "mlp": "mlp", "mlp6": "mlp6", "resmlp": "resmlp", "cnn": "cnn", "lstm": "lstm",
    "pre-ln": "pre-ln", "post-ln": "post-ln", "byte-pre-ln": "byte-pre-ln",
    "byte-post-ln": "byte-post-ln", "gru": "gru", "gpt": "gpt", "gpt-qk": "gpt",
    "gpt-wide": "gpt-wide", "gpt-wide-qk": "gpt-wide", "gpt-deep": "gpt-deep",
    "gpt-deep-qk": "gpt-deep", "gpt-6h": "gpt-6h", "gpt-6h-qk": "gpt-6h", "cnn-m": "cnn-m",
    "bnmlp": "bnmlp", "gru2": "gru2", "lstm2": "lstm2", "resmlp-digits": "resmlp-digits",
    "gpt-h32": "gpt-h32", "gpt-h32-qk": "gpt-h32", "gpt-h32-deep": "gpt-h32-deep",
    "gpt-h32-deep-qk": "gpt-h32-deep", "ft": "ft", "ft-lora": "ft-lora",
    "resmlp-wine": "resmlp-wine", "ft-mix-lora": "ft-mix-lora", "ft-gru-mix": "ft-gru-mix",
}  # fmt: skip


def family(run: Run) -> str:  # noqa: PLR0911 (one return per kind of family)
    """The run's family: its model (a GPT with its qk-layernorm twin), the long CNN recipe and
    the output-logit runs apart."""
    if run.model.startswith("gpt") and not run.zloss:
        return "gpt-logits"
    if run.model == "cnn" and run.steps != STEPS:
        return "cnn-long"
    if run.model == "resmlp" and run.schedule == "step":
        return "resmlp-step"
    if run.model == "wine":
        return f"wine-{run.optimizer}"
    if run.model == "ft-mix":
        return "ft-mix-mb1" if run.accum == 1 else "ft-mix-accum"
    if run.model in DEAD_MODELS:
        return f"{run.model}-{run.optimizer}"
    if run.model in NEW_MODELS or run.model in FRESH_MODELS | FRESH2_MODELS:
        return run.model
    return FAMILY[run.model]


HELD_OUT_FAMILIES = frozenset(
    {"resmlp", "lstm", "post-ln", "byte-post-ln", "cnn-long", "gpt-wide", "gpt-logits"}
    | {"bnmlp", "lstm2", "resmlp-digits", "gpt-h32-deep", "wine-adam", "ft-lora"}
    | {"ft-mix-accum", "ft-mix-lora"}
)
"""The families the defaults were not chosen on, frozen before any default was tuned on them.
Each failure has a family on each side: char-level transformers on plain Adam (``byte-pre-ln``
tunes, ``byte-post-ln`` is held out), recurrent models on RMSprop with clipping (``gru``,
``gru2``; ``lstm``, ``lstm2``), attention collapse (``gpt``, ``gpt-h32``; ``gpt-wide``,
``gpt-h32-deep``), explosions (``mlp6``; ``resmlp``), early transients under SGD with momentum
(``cnn-m``; ``bnmlp``), Adam on a residual MLP with LayerNorm and a step schedule
(``resmlp-step``; ``resmlp-digits``), small batches (``wine-sgd``; ``wine-adam``),
fine-tuning a pretrained GPT (``ft``, whole; ``ft-lora``, adapters on the frozen base) and
fine-tuning it on documents of mixed difficulty (``ft-mix-mb1``, whole at a micro-batch of 1;
``ft-mix-accum``, whole at 2 x 8 accumulated, and ``ft-mix-lora``, adapters)."""
NEW_HELD_OUT = frozenset(
    {"relu-mlp-digits-adam", "relu-cnn-digits-sgd", "relu-mlp-cancer-sgd", "relu-cnn-cancer-adam"}
    | {"frozen-cancer", "branch-digits", "moe-cancer", "outlier-wine", "outlier-cnn-digits"}
)
"""The held-out half of the dead-network, idling and outlier families, frozen when they were
recorded, before any rule was tuned on them, by family of model, data and recipe (never by
seed): of the dead networks, one optimizer per model and data set, so that each half has both
models, both data sets and both optimizers; one data set of each idling model; the two outlier
families beyond the two that showed the false alarms (the wine set's MLP and the digits CNN)."""
FRESH_FAMILIES = frozenset({"gpt-deep", "gpt-6h", "resmlp-wine", "ft-gru-mix"})
"""Families recorded only after the defaults they are judged on were frozen: a half no
default has seen. Reported apart from both halves."""
NEW_FRESH = FRESH_MODELS | FRESH_OUTLIER_MODELS
"""The fresh families of :data:`FRESH_LRS`, frozen with the rule for outlier batches under SGD
with momentum before it was judged on them, and the fresh outlier families
(:data:`FRESH_OUTLIER_MODELS`): the fresh half with :data:`FRESH_FAMILIES`."""


SMALL_BATCH = frozenset(
    {"wine-sgd", "wine-adam", "resmlp-wine", "ft", "ft-lora", "ft-mix-mb1", "ft-mix-accum"}
    | {"ft-mix-lora", "ft-gru-mix"}
)
"""The small-batch and fine-tuning families: micro-batches of 1-4, with or without
accumulation, where the loss swings most from one micro-batch to the next."""


def group(name: str) -> str:
    """The half a family is reported in: ``tuning``, ``held_out``, ``fresh`` or ``fresh2``."""
    if name in FRESH2_MODELS:
        return "fresh2"
    if name in FRESH_FAMILIES | NEW_FRESH:
        return "fresh"
    return "held_out" if name in HELD_OUT_FAMILIES | NEW_HELD_OUT else "tuning"


def _optimizer(run: Run, model: nn.Module) -> torch.optim.Optimizer:  # noqa: PLR0911 (one return per optimizer)
    params = model.parameters()
    if run.optimizer == "sgd":
        momentum = 0.0 if run.model == "lstm" else 0.9
        return torch.optim.SGD(params, lr=run.lr, momentum=momentum)
    if run.optimizer == "nesterov":
        return torch.optim.SGD(params, lr=run.lr, momentum=0.9, nesterov=True)
    if run.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=run.lr, weight_decay=0.01)
    if run.optimizer == "rmsprop":
        return torch.optim.RMSprop(params, lr=run.lr)
    if run.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=run.lr)
    if run.model.startswith("ft"):  # a fine-tune: the trainable parameters only
        params = (p for p in model.parameters() if p.requires_grad)
    if run.optimizer == "adamw95":  # Wortsman et al.'s AdamW: independent weight decay 1e-4
        return torch.optim.AdamW(params, lr=run.lr, betas=(0.9, 0.95), weight_decay=1e-4 / run.lr)
    return torch.optim.Adam(params, lr=run.lr)


def _tabular(model: str) -> Callable[[], tuple[torch.Tensor, torch.Tensor]] | None:
    """The data set of a model on scikit-learn's sets; ``None`` for a text model."""
    if model in FRESH_MODELS | FRESH2_MODELS:  # named by its data set, last
        return {
            "wine": _wine, "digits": _digits, "cancer": _cancer, "iris": _iris,
            "synth": _synth, "diabetes": _diabetes,
        }[model.rsplit("-", 1)[1]]  # fmt: skip
    if model in ("resmlp", "wine", "resmlp-wine") or model.endswith(("-wine", "-cancer")):
        return {"resmlp": _cancer, "wine": _wine, "resmlp-wine": _wine}.get(
            model, _wine if "wine" in model else _cancer
        )
    if model in ("mlp", "mlp6", "cnn", "cnn-m", "bnmlp", "resmlp-digits"):
        return _digits
    return _digits if model.endswith("-digits") else None


def _batches(run: Run, gen: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    data = _tabular(run.model)
    if data is not None:
        x, y = data()
        while True:
            idx = torch.randint(0, len(x), (run.batch or 32,), generator=gen)
            yield x[idx], y[idx]
    if run.model in MIXED:
        yield from _mixed_batches(run.batch or 16, gen)
    if run.model in ("lstm", "pre-ln", "post-ln"):
        text, seq = _text(), _SEQ
    else:
        source = BYTE_TEXT.get(run.model) or GPT_TEXT[run.model.removesuffix("-qk")]
        text, seq = families.byte_text(source), families.SEQ
    while True:
        start = torch.randint(0, len(text) - seq - 1, (run.batch or 16,), generator=gen)
        window = torch.stack([text[s : s + seq + 1] for s in start.tolist()])
        yield window[:, :-1], window[:, 1:]


def _mixed_batches(batch: int, gen: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Windows of one document of :data:`families.MIXED_DOCS` a micro-batch, the document drawn
    at random: the loss swings with the document's difficulty."""
    docs = [families.byte_text(name) for name in families.MIXED_DOCS]
    seq = families.SEQ
    while True:
        text = docs[int(torch.randint(0, len(docs), (1,), generator=gen))]
        start = torch.randint(0, len(text) - seq - 1, (batch,), generator=gen)
        window = torch.stack([text[s : s + seq + 1] for s in start.tolist()])
        yield window[:, :-1], window[:, 1:]


def _layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that own trainable parameters (a frozen base's are not watched)."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if any(p.requires_grad for p in m.parameters(False))
    ]


def train(
    run: Run, built: Callable[[nn.Module], object] | None = None
) -> Iterator[tuple[nn.Module, ParamLayout, torch.Tensor, torch.Tensor]]:
    """Train ``run`` for ``run.steps`` steps from its seed: yields the model, its layout, the output
    and the loss after each backward (with accumulation: the last micro-batch's output and every
    micro-batch's loss), before the optimizer step, which runs when the caller asks for the next
    step (and after the last one, when the loop ends). ``built`` sees the model before its first
    forward (to hook it)."""
    torch.manual_seed(run.seed)
    gen = torch.Generator().manual_seed(run.seed)
    model = BUILD[run.model]()
    if built is not None:
        built(model)
    opt = _optimizer(run, model)
    layout = ParamLayout.from_modules(_layers(model))
    batches = _batches(run, gen)
    at_step = getattr(model, "at_step", None)  # a model that idles a part over some steps
    for step in range(run.steps):
        for group in opt.param_groups:
            group["lr"] = run.lr_at(step)
        if at_step is not None:
            at_step(step)
        opt.zero_grad()
        micro = []
        odd = run.outlier_step(step)
        for _ in range(run.accum):  # Lightning's accumulation: each micro-batch's loss / accum
            x, y = next(batches)
            out, loss = _forward(run, model, x, y, odd)
            (loss / run.accum).backward()
            micro.append(loss.detach())
        loss = loss if run.accum == 1 else torch.stack(micro)
        if step == run.explode_at:  # a bad batch, a numerical fault: the gradient blows up
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(run.explode)
        yield model, layout, out, loss
        if run.clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), run.clip)
        opt.step()


def _forward(
    run: Run, model: nn.Module, x: torch.Tensor, y: torch.Tensor, odd: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's output and loss (cross-entropy, plus the z-loss); on an outlier step
    (``odd``), with its labels shifted by one class, or its loss (and so its gradient) scaled."""
    out = model(x)
    logits = out.reshape(-1, out.shape[-1])
    if odd and run.shifted:  # wrong labels: each shifted by one class
        y = (y + 1) % logits.shape[-1]
    loss = nn.functional.cross_entropy(logits, y.reshape(-1))
    if run.zloss:
        loss = loss + run.zloss * torch.logsumexp(logits, -1).square().mean()
    if odd:  # an outlier batch: its loss, and so its gradient, scaled
        loss = loss * run.outlier
    return out, loss


def grad_norms(layout: ParamLayout) -> np.ndarray:
    """Per-layer gradient L2 norms, then the global one (a parameter without a gradient: 0)."""
    grads = [p.grad if p.grad is not None else p.new_zeros(1) for p in layout.params]
    with torch.no_grad():
        return segment_norm(param_norms(grads), layout.index, len(layout.layers)).numpy().copy()


def record(run: Run) -> dict[str, Any]:
    """Train ``run`` and record what the every-step check reads each step: per-layer gradient norms
    (then the global one) and the loss; also the weight norms, for rules that want them."""
    norms, weights, losses, updates, micro, stepped = [], [], [], [], [], []
    layers: list[str] = []
    last: list[torch.Tensor] | None = None
    grads: list[torch.Tensor | None] = []
    probe = _StabilityProbe() if run.model.startswith(("gpt", "ft")) else None
    relus = _ReluProbe() if run.model in NEW_MODELS else None
    hook = probe.attach if probe is not None else relus.attach if relus is not None else None
    for step, (model, layout, _, loss) in enumerate(train(run, hook)):
        if probe is not None:
            probe.step(step)
        if relus is not None:
            relus.take()
        layers = layout.layers
        norms.append(grad_norms(layout))
        stepped.append(_stepped(layout))
        with torch.no_grad():
            n = len(layout.layers)
            weights.append(segment_norm(param_norms(layout.params), layout.index, n).numpy().copy())
            now = [p.detach().clone() for p in model.parameters()]
            if last is not None:  # the previous step's typical update, as the callback reads it
                updates.append(float(typical_update(last, now, grads)))
            last = now
            grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        losses.append(float(loss.detach().mean()))
        micro.append(loss.detach().reshape(-1).double().numpy())
    updates.append(math.nan)  # the last step's update is not read
    return {
        "run": asdict(run),
        "layers": [*layers, "global"],
        "norms": np.array(norms, dtype=np.float64),
        "weights": np.array(weights, dtype=np.float64),
        "losses": np.array(losses, dtype=np.float64),
        "updates": np.array(updates, dtype=np.float64),
        "lrs": np.array([run.lr_at(s) for s in range(run.steps)], dtype=np.float64),
        "stability": [] if probe is None else probe.windows,
        # the micro-batches' losses, as the callback reads them (with accumulation)
        **({"micro_losses": np.array(micro)} if run.accum > 1 else {}),
        # the rows some gradient reached, when a layer had none on some step
        **({} if all(map(all, stepped)) else {"stepped": np.array(stepped, dtype=bool)}),
        **({} if relus is None else relus.arrays()),
    }


def _stepped(layout: ParamLayout) -> list[bool]:
    """Per layer, whether a gradient reached any of its parameters (the callback leaves a layer
    with none out of the rules), then the global row: any."""
    rows = [False] * len(layout.layers)
    for owner, p in zip(layout.owner, layout.params, strict=True):
        rows[owner] = rows[owner] or p.grad is not None
    return [*rows, any(rows)]


class _ReluProbe:
    """Per ``nn.ReLU`` module, on each optimizer step's batches (every micro-batch): whether it
    ran (on a non-empty input), and whether any of its units fired (an output above 0); the
    ground truth of a dead network (:func:`death`)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.fired: list[list[bool]] = []
        self.ran: list[list[bool]] = []
        self._fired: list[bool] = []
        self._ran: list[bool] = []

    def attach(self, model: nn.Module) -> None:
        """Hook every ``nn.ReLU`` of ``model``."""
        relus = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ReLU)]
        self.names = [n for n, _ in relus]
        self._fired = [False] * len(relus)
        self._ran = [False] * len(relus)
        for index, (_, module) in enumerate(relus):
            module.register_forward_hook(partial(self._seen, index))

    def _seen(self, index: int, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if out.numel():
            self._ran[index] = True
            self._fired[index] = self._fired[index] or bool((out > 0).any())

    def take(self) -> None:
        """Close the step: keep its record, start the next."""
        self.fired.append(self._fired)
        self.ran.append(self._ran)
        self._fired = [False] * len(self.names)
        self._ran = [False] * len(self.names)

    def arrays(self) -> dict[str, Any]:
        """What the trace keeps: ``relus`` (names), ``fired`` and ``ran`` (``[steps, relus]``)."""
        shape = (len(self.fired), len(self.names))  # a model without a ReLU: no columns
        return {
            "relus": self.names,
            "fired": np.array(self.fired, dtype=bool).reshape(shape),
            "ran": np.array(self.ran, dtype=bool).reshape(shape),
        }


def logging_step(step: int) -> bool:
    """Whether ``step`` is a logging step of the Trainer at ``log_every_n_steps=50``."""
    return step == 0 or (step + 1) % LOG_EVERY == 0


class _StabilityProbe:
    """The library's own :class:`StabilityStats` on the logging steps: the largest attention
    logit, the smallest head entropy and the output logits' log-partition, per layer, as
    ``GradFlowCallback`` logs them at each logging step."""

    def __init__(self) -> None:
        self.stat = StabilityStats()
        self.windows: list[tuple[int, dict[str, dict[str, float]]]] = []

    def attach(self, model: nn.Module) -> None:
        self.stat.attach(model)

    def step(self, step: int) -> None:
        """After ``step``'s backward: read its window on a logging step; gate the next one."""
        registry = self.stat.registry
        assert registry is not None
        if logging_step(step):
            self.stat.end_step()
            self.stat.start_copy(step)
            got = self.stat.take_copy(wait=True)
            assert got is not None
            at, result = got
            self.windows.append((at, result._asdict()))  # by statistic, as the replay reads it
        registry.logging_step = logging_step(step + 1)


def all_runs() -> list[Run]:
    """The sweep, the recipes and the families on every seed, the attention and logit families
    on one, the explosions on seeds 0 and 1, then the families of transients, collapses at
    constant rates, small batches and fine-tuning on seeds 0 and 1."""
    runs = [replace(run, seed=seed) for seed in SEEDS for run in (*SWEEP, *RECIPES, *UNSEEN)]
    runs += [replace(run, seed=seed) for seed in ATTENTION_SEEDS for run in (*ATTENTION, *LOGITS)]
    runs += [
        replace(run, seed=seed, explode_at=at)
        for seed, at in EXPLODE_AT.items()
        for run in EXPLOSIONS
    ]
    runs += [
        replace(run, seed=seed)
        for seed in NEW_SEEDS
        for run in (
            *TRANSIENTS,
            *COLLAPSES,
            *FINE_TUNING,
            *FINE_TUNING_MIXED,
            *FRESH_RUNS,
            *FRESH2_RUNS,
        )
    ]
    return runs + new_runs()


def new_runs() -> list[Run]:
    """The dead-network, idling and outlier families, on seeds 0 and 1."""
    return [replace(run, seed=seed) for seed in NEW_SEEDS for run in (*DEAD, *IDLING, *OUTLIERS)]


QUICK = frozenset(
    {"mlp", "mlp6", "cnn", "resmlp", "cnn-m", "bnmlp", "resmlp-digits", "wine", "resmlp-wine"}
    | {"lstm", "pre-ln", "post-ln"}
    | NEW_MODELS
    | FRESH_MODELS
    | FRESH2_MODELS
)
"""The models quick to record on a CPU (a second or two a run): the digits, tabular and
character-level ones. The byte-level transformers and recurrent models, the GPTs and the
fine-tunes take roughly 50 minutes of one core more (estimated)."""


def quick_runs() -> list[Run]:
    """The runs of :func:`all_runs` on :data:`QUICK` models."""
    return [r for r in all_runs() if r.model in QUICK]


def record_all(
    path: Path,
    record: Callable[[Run], dict[str, Any]] = record,
    runs: Callable[[], list[Run]] | None = None,
    again: bool = True,
) -> list[dict[str, Any]]:
    """Every run of ``runs()`` (default: the sweep on every seed), recorded by
    ``record`` and saved to ``path``; with ``again=False``, the runs already in ``path`` are
    kept (those not in ``runs()`` too, after them) and only the missing ones recorded."""
    started = time.perf_counter()
    todo = runs() if runs is not None else [replace(r, seed=s) for s in SEEDS for r in SWEEP]
    kept = {} if again or not path.exists() else _by_run(torch.load(path, weights_only=False))
    wanted = {_run_key(asdict(run)) for run in todo}
    others = [t for key, t in kept.items() if key not in wanted]
    traces = []
    for run in todo:
        t = kept.get(_run_key(asdict(run)))
        if t is None:
            t = record(run)
            print(
                f"{time.perf_counter() - started:5.0f}s {run.name} seed {run.seed}: loss "
                f"{t['losses'][0]:.3g} -> {np.nanmin(t['losses']):.3g} -> "
                f"{t['losses'][-1]:.3g}, diverges at {divergence_step(t['losses'])}",
                file=sys.stderr,
            )
        traces.append(t)
    traces += others
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(traces, path)
    return traces


def _run_key(run: dict[str, Any]) -> str:
    return json.dumps(asdict(Run(**run)), sort_keys=True)


def _by_run(traces: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {_run_key(t["run"]): t for t in traces}


# --- ground truth -----------------------------------------------------------------------------


RECOVERED = 0.5  # a run that ends below this share of its first loss is not divergent
# a warning on confirmation is in time this many steps, or this share of the run, after the
# divergence step (whichever is more)
CONFIRM_STEPS, CONFIRM_SHARE = 3, 0.01
TAIL = 50  # the steps whose mean loss is the run's end


def divergence_step(losses: np.ndarray) -> int | None:
    """First step where the loss is not finite, or where the mean of the last ``SMOOTH`` losses
    is >= 2x its best so far and has given back >= half of what it had learnt (best vs the first
    step's loss); ``None``: healthy. A run that recovers (its mean loss over the last ``TAIL``
    steps is below ``RECOVERED`` x its first loss) is not divergent, whatever happened on the
    way: a transient."""
    step = _first_divergence(losses)
    return None if step is not None and recovered(losses) else step


def recovered(losses: np.ndarray) -> bool:
    """The run ends finite, below ``RECOVERED`` x its first loss."""
    tail = float(np.mean(losses[-TAIL:]))
    return math.isfinite(tail) and tail < RECOVERED * float(losses[0])


def _first_divergence(losses: np.ndarray) -> int | None:
    first, best = losses[0], math.inf
    for step, loss in enumerate(losses):
        if not math.isfinite(loss):
            return step
        mean = float(np.mean(losses[max(0, step - SMOOTH + 1) : step + 1]))
        best = min(best, mean)
        if mean >= 2.0 * best and mean - best >= 0.5 * max(first - best, 0.0):
            return step
    return None


# --- the rule sets: ours (the real TrainingAlarms) and the peers' (from their sources) --------


def ours(
    rules: AlarmRules, warn: tuple[str, ...] = WARNED
) -> Callable[[dict[str, Any]], list[int]]:
    """This library's every-step check at ``rules``: the steps of its alarms of the ``warn`` rules
    (by default, those that warn under ``GradFlowCallback``'s default ``on_alarm="warn"``), fed
    as the callback feeds it: the pre-clip norms and the clip every step; on the logging steps
    (every ``LOG_EVERY``) the typical update and the learning rate, and the attention
    statistics ``StabilityStats`` measured."""

    def replay(trace: dict[str, Any]) -> list[int]:
        return [a.step for a in replay_alarms(trace, rules) if a.rule in warn]

    return replay


def replay_alarms(trace: dict[str, Any], rules: AlarmRules) -> list[TrainingAlarm]:
    """Every alarm of this library's every-step check at ``rules`` on ``trace``, in order, fed as
    the callback feeds it (see :func:`ours`); a layer no gradient reached on a step (``stepped``)
    is out of the rules that step, as the callback leaves it."""
    alarms = TrainingAlarms(trace["layers"], rules)
    now = [0]  # the step being replayed: the learning rate the callback would read at it
    lrs = trace["lrs"]
    alarms.set_run_facts(RunFacts(lambda: float(lrs[now[0]]), output_units(trace["run"]["model"])))
    clip = trace["run"].get("clip")
    stepped = trace.get("stepped")
    # the callback reads the stall on optimizers with a second moment (traces recorded
    # before the updates were carry none)
    adaptive = trace["run"]["optimizer"] in ADAPTIVE
    stall = adaptive and "updates" in trace
    windows = dict(trace.get("stability", []))
    alarms.set_adaptive(adaptive)  # as GradFlowTracker.observe sets it from the optimizer
    found: list[TrainingAlarm] = []
    # with accumulation, the callback reads every micro-batch's loss
    losses = trace.get("micro_losses", trace["losses"][:, None])
    for step, (norm, micro) in enumerate(zip(trace["norms"], losses, strict=True)):
        now[0] = step
        rows = None if stepped is None or stepped[step].all() else stepped[step]
        alarms.update(
            torch.from_numpy(norm).float(),
            step=step,
            clip=clip,
            stepped=None if rows is None else torch.from_numpy(rows),
        )
        for loss in micro:
            alarms.update_loss(torch.tensor(loss, dtype=torch.float32), step=step)
        if logging_step(step) and stall:
            update = torch.tensor(trace["updates"][step], dtype=torch.float32)
            alarms.update_stall(update, float(trace["lrs"][step]), step=step)
        if step in windows:
            attn = windows[step]
            alarms.update_attention(attn["attn_logit_max"], attn["attn_entropy_min"], step=step)
        found += alarms.poll()
    return found


@cache
def output_units(model: str) -> int | None:
    """The output layer's units of ``model`` as ``RunFacts.of`` finds them (its last
    ``nn.Linear``), for the models quick to build (:data:`QUICK`; a fine-tune's base would be
    trained first): what ``GradFlowCallback`` hands the alarms."""
    if model not in QUICK:
        return None
    return RunFacts.of(BUILD[model](), []).classes


def olmo_skip_step(trace: dict[str, Any]) -> list[int]:
    """OLMo-core ``SkipStepOptimizer.get_step_factor`` (src/olmo_core/optim/skip_step_optimizer.py):
    the last ``rolling_interval_length + 1`` = 129 losses and grad norms; once there are
    ``max(20, 128 // 2)`` losses, skip when ``|x - mean| / std`` (over the previous ones, torch's
    unbiased std) exceeds ``sigma_factor=6`` for the loss or the grad norm."""
    found = []
    for step in range(len(trace["losses"])):
        lo = max(0, step - 128)
        if step + 1 - lo < 64:
            continue
        for series in (trace["losses"], trace["norms"][:, -1]):
            past, now = series[lo:step], series[step]
            with np.errstate(invalid="ignore", divide="ignore"):
                z = abs(now - past.mean()) / past.std(ddof=1)
            if not z <= 6.0:  # NaN (a non-finite value) skips too
                found.append(step)
                break
    return found


def olmo_stability(trace: dict[str, Any]) -> list[int]:
    """OLMo-core ``StabilityMonitorCallback._is_spike`` (src/olmo_core/train/callbacks/
    stability_monitor.py): ``x > mean + 6 std`` over the last ``window_size=128`` values
    (population std, only with a full window, not when ``std < 1e-10``), loss or grad norm."""
    found = []
    for step in range(128, len(trace["losses"])):
        for series in (trace["losses"], trace["norms"][:, -1]):
            past = series[step - 128 : step]
            mean, std = past.mean(), past.std()
            if std >= 1e-10 and series[step] > mean + 6.0 * std:
                found.append(step)
                break
    return found


def foundry_kill_loss_spike(trace: dict[str, Any]) -> list[int]:
    """llm-foundry ``KillLossSpike`` (llmfoundry/callbacks/kill_loss_spike_callback.py) at its
    defaults, run after each optimizer step as Composer's ``BATCH_END``: with a full window of
    100 losses (``max(100, 5%`` of the run's 300 steps``)``), a loss ``>= 2x`` the window's mean
    for more than ``patience=4`` steps in a row; failing that, from batch 200 (twice the window),
    half the window above ``loss_cap=10``. Composer advances ``state.timestamp.batch`` before
    ``BATCH_END``, so the batch count at step ``s`` (0-based) is ``s + 1``: the check that would
    lower the cap to the first window's largest loss (``current_step == window_size``) never
    holds once the window is full, and the cap stays 10."""
    window_size, loss_cap, patience = 100, 10.0, 4
    found: list[int] = []
    window: list[float] = []
    outliers = 0
    for step, loss in enumerate(trace["losses"]):
        if len(window) == window_size:
            mean = float(np.mean(window))
            spike = False
            if loss >= 2.0 * mean:
                outliers += 1
                spike = outliers > patience
            else:
                outliers = 0
            high = step + 1 >= 2 * window_size and (
                sum(v > loss_cap for v in window) >= window_size / 2
            )
            if spike or high:
                found.append(step)
        window = [*window[-(window_size - 1) :], loss]
    return found


def lightning_spike_detection(trace: dict[str, Any]) -> list[int]:
    """Lightning's ``SpikeDetection`` (lightning/fabric/utilities/spike.py) at its defaults:
    ``mode="min"``, running mean of the last ``window=10`` losses, ``warmup=1``, ``rtol=2``,
    ``finite_only=True``: a non-finite loss, or one that is not better than the last and is
    ``>= 2x`` the running mean away from it. It raises at the first; the replay goes on."""
    found, window, last = [], [], 0.0
    for step, loss in enumerate(trace["losses"]):
        mean = float(np.mean(window)) if window else 0.0
        spike = step >= 1 and (
            not math.isfinite(loss) or (loss - last > 0 and abs(loss - mean) >= 2.0 * mean)
        )
        if spike:
            found.append(step)
        else:
            window = [*window[-9:], loss]
            last = loss
    return found


def zclip(trace: dict[str, Any]) -> list[int]:
    """ZClip's trigger (bluorion-com/ZClip, zclip/zclip.py) at its defaults: ``alpha=0.97``,
    ``z_thresh=2.5``, ``warmup_steps=25``, ``mode="zscore"``, ``clip_option="adaptive_scaling"``:
    ``(g - mean) / (std + 1e-6) > 2.5`` on the global grad norm; the EMA takes the clipped value."""
    found: list[int] = []
    buffer: list[float] = []
    mean = var = 0.0
    for step, g in enumerate(trace["norms"][:, -1]):
        if len(buffer) < 25:
            buffer.append(float(g))
            if len(buffer) == 25:
                mean = float(np.mean(buffer))
                var = float(np.mean([(x - mean) ** 2 for x in buffer]))
            continue
        std = var**0.5
        z = (g - mean) / (std + 1e-6)
        value = g
        if not z <= 2.5:
            found.append(step)
            value = mean + 2.5 * std / (z / 2.5) if math.isfinite(z) else mean
        mean = 0.97 * mean + 0.03 * value
        var = 0.97 * var + 0.03 * (value - mean) ** 2
    return found


PEERS: dict[str, Callable[[dict[str, Any]], list[int]]] = {
    "OLMo-core SkipStepOptimizer (6 sigma, 128 steps, loss and grad norm)": olmo_skip_step,
    "OLMo-core StabilityMonitorCallback (6 sigma, 128 steps, loss and grad norm)": olmo_stability,
    "llm-foundry KillLossSpike (2x the mean of 100, patience 4)": foundry_kill_loss_spike,
    "Lightning SpikeDetection (loss, window 10, rtol 2)": lightning_spike_detection,
    "ZClip trigger (EMA alpha 0.97, z > 2.5, warm-up 25)": zclip,
}


# --- the table --------------------------------------------------------------------------------


def damaging(trace: dict[str, Any], twin: dict[str, Any]) -> bool:
    """Ground truth of an explosion: its run's mean loss over ``DAMAGE_WINDOW`` steps after it
    is not finite, or clearly above its twin's (the same seed and data without the event):
    ``DAMAGE_RATIO`` times it plus ``DAMAGE_MARGIN`` times the twin's first loss, a margin
    in the loss's own scale (a 2-class loss starts at ln 2, a 10-class one at ln 10)."""
    at = trace["run"]["explode_at"]
    lo, hi = at + DAMAGE_WINDOW[0], min(at + DAMAGE_WINDOW[1], len(trace["losses"]))
    hurt, base = (float(np.mean(t["losses"][lo:hi])) for t in (trace, twin))
    margin = DAMAGE_MARGIN * float(twin["losses"][0])
    return not math.isfinite(hurt) or hurt > DAMAGE_RATIO * base + margin


def _key(run: dict[str, Any]) -> tuple[str, int]:
    return Run(**run).name, run["seed"]


FINAL = 100  # the last steps whose mean loss compares a run with its twin
TWIN_RATIO = 1.05  # "worse than its twin": this ratio, plus DAMAGE_MARGIN x the twin's first loss


def twin_of(run: Run) -> tuple[str, Run] | None:
    """The kind of failure a run is judged on against a twin, and the twin: ``attention`` (a GPT
    without qk-layernorm; the twin has it) or ``logits`` (a GPT without z-loss; the twin has
    z-loss 1e-4); ``None`` for the other runs."""
    if run.model in GPT_TEXT:
        return "attention", replace(run, model=f"{run.model}-qk")
    if family(run) == "gpt-logits":
        return "logits", replace(run, zloss=1e-4)
    return None


def worse_than_twin(trace: dict[str, Any], twin: dict[str, Any]) -> bool:
    """Ground truth against a twin: the run's mean loss over its last ``FINAL`` steps is not
    finite, or above ``TWIN_RATIO`` x its twin's plus ``DAMAGE_MARGIN`` x the twin's first
    loss (0.11 nats on 256 bytes: undamaged pairs end within 0.15 nats, damaged ones 0.5 to 0.8
    apart)."""
    hurt, base = (float(np.mean(t["losses"][-FINAL:])) for t in (trace, twin))
    margin = DAMAGE_MARGIN * float(twin["losses"][0])
    return not math.isfinite(hurt) or hurt > TWIN_RATIO * base + margin


def score_explosions(
    traces: list[dict[str, Any]], replay: Callable[[dict[str, Any]], list[int]]
) -> dict[str, Any]:
    """Per explosion: damaging or harmless (against its twin), warned at its step, any
    warning; totals."""
    twins = {_key(t["run"]): t for t in traces if t["run"]["explode_at"] is None}
    rows = []
    for trace in (t for t in traces if t["run"]["explode_at"] is not None):
        found = sorted(replay(trace))
        twin = twins[_key(asdict(Run(**trace["run"]).twin))]
        rows.append(
            {
                "run": Run(**trace["run"]).name,
                "seed": trace["run"]["seed"],
                "family": family(Run(**trace["run"])),
                "at": trace["run"]["explode_at"],
                "damaging": damaging(trace, twin),
                "warned_at_step": trace["run"]["explode_at"] in found,
                "first_warning": found[0] if found else None,
            }
        )
    return {"runs": rows, **_explosion_totals(rows)}


def _explosion_totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    hurt = [r for r in rows if r["damaging"]]
    harmless = [r for r in rows if not r["damaging"]]
    return {
        "damaging": len(hurt),
        "damaging_warned": sum(r["warned_at_step"] for r in hurt),
        "harmless": len(harmless),
        "harmless_warned": sum(r["first_warning"] is not None for r in harmless),
    }


def score(
    traces: list[dict[str, Any]],
    replay: Callable[[dict[str, Any]], list[int]],
    setbacks: Callable[[dict[str, Any]], list[int]] | None = None,
    every: bool = False,
) -> dict[str, Any]:
    """Per run without an explosion (``every``: also those of :data:`NEW_MODELS`, else only the
    main replay's): its family, the divergence step, the damage against a twin (``None``: no
    twin), whether it is harmed (:func:`harmed`), the first warning and (``setbacks``: their
    replay) the setbacks logged; totals."""
    by_key = {
        _key(t["run"]): t
        for t in traces
        if t["run"].get("explode_at") is None and (every or t["run"]["model"] not in NEW_MODELS)
    }
    best = family_bests(list(by_key.values()))
    rows = []
    for trace in by_key.values():
        run = Run(**trace["run"])
        found = sorted(replay(trace))
        judged = twin_of(run)
        twin = None if judged is None else by_key.get(_key(asdict(judged[1])))
        finite = np.isfinite(trace["losses"])
        rows.append(
            {
                "run": run.name,
                "seed": run.seed,
                "family": family(run),
                "steps": run.steps,
                "diverges_at": divergence_step(trace["losses"]),
                "first_nonfinite": None if finite.all() else int(np.argmin(finite)),
                "kind": None if judged is None else judged[0],
                "damaged": None if twin is None else worse_than_twin(trace, twin),
                "first_warning": found[0] if found else None,
                "warnings": len(found),
                "setbacks": None if setbacks is None else len(setbacks(trace)),
                "end": end_loss(trace["losses"]),
                "harmed": harmed(trace["losses"], best[recipe(run)]),
            }
        )
    return {"runs": rows, **_totals(rows)}


# --- the second label: ends as well as the best run of its family -----------------------------

HARM_RATIO = 1.10
"""A run ends as well as its family's best when its :func:`end_loss` is at most
``max(HARM_RATIO x best, best + HARM_MARGIN)``; else it is harmed."""
HARM_MARGIN = 0.05
"""See :data:`HARM_RATIO`: the margin in the loss's units, for a best near 0."""


def recipe(run: Run) -> str:
    """The family a run's end is judged in (:func:`harmed`): the same model (and so the same
    data and architecture), optimizer, schedule, clipping, z-loss, length, batch and
    accumulation; any learning rate, any seed, and without an injected event (an explosion or
    an outlier batch: such a run is judged against the runs without it)."""
    bare = replace(run.clean.twin, lr=0.0, seed=0)
    return json.dumps(asdict(bare), sort_keys=True)


def end_loss(losses: np.ndarray) -> float:
    """The mean of the last :data:`TAIL` (50) training losses (``inf``: not finite)."""
    tail = float(np.mean(losses[-TAIL:]))
    return tail if math.isfinite(tail) else math.inf


def family_bests(traces: list[dict[str, Any]]) -> dict[str, float]:
    """Per :func:`recipe`, the best (lowest) :func:`end_loss` of its runs in ``traces``."""
    best: dict[str, float] = {}
    for trace in traces:
        key = recipe(Run(**trace["run"]))
        best[key] = min(best.get(key, math.inf), end_loss(trace["losses"]))
    return best


def harmed(losses: np.ndarray, best: float) -> bool:
    """The run ends worse than the best run of its family (:func:`recipe`): its
    :func:`end_loss` is not finite, or above ``max(1.10 x best, best + 0.05)``. A warning on a
    run that is not harmed (and not divergent) is a false alarm by this label."""
    end = end_loss(losses)
    if not math.isfinite(end):
        return True
    return end > max(HARM_RATIO * best, best + HARM_MARGIN)


def _label_totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Both labels over ``rows``: runs, divergent (the loss's ground truth), harmed (the end
    against the family's best), harmed or divergent, warned; of the warned, those harmed or
    divergent and the precision (their share), those the old label calls healthy (not
    divergent nor worse than a twin) and those the new one calls unharmed (neither harmed nor
    divergent: its false alarms); the harmed or divergent runs warned."""
    bad = [r for r in rows if r["harmed"] or r["diverges_at"] is not None]
    warned = [r for r in rows if r["first_warning"] is not None]
    true = [r for r in warned if r["harmed"] or r["diverges_at"] is not None]
    return {
        "runs": len(rows),
        "divergent": sum(r["diverges_at"] is not None for r in rows),
        "harmed": sum(bool(r["harmed"]) for r in rows),
        "bad": len(bad),
        "warned": len(warned),
        "warned_bad": len(true),
        "precision": len(true) / len(warned) if warned else None,
        "warned_old_healthy": sum(
            r["diverges_at"] is None and not r.get("damaged") for r in warned
        ),
        "warned_unharmed": len(warned) - len(true),
        "bad_warned": sum(r["first_warning"] is not None for r in bad),
    }


def label_halves(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`_label_totals` per half (:data:`HALVES`) and over every run (``all``)."""
    halves = {h: _label_totals([r for r in rows if group(r["family"]) == h]) for h in HALVES}
    return {**halves, "all": _label_totals(rows)}


# --- dead networks, idling layers, outlier batches: the defaults' alarms -----------------------

DEATH_SILENT = 10
"""A ReLU layer silent (no unit firing on any of a step's batches) on at least this many steps
with an input, to the end of the run, is dead."""
WITHIN = 10
"""A dead network is warned in time when warned no later than this many optimizer steps after
its death."""
NOTICED = (
    *(rule for rule, notice in NOTICES.items() if not notice.acts and rule in ALARM_RULES),
    *(r for r, a in check_actions("warn", "GradFlowCallback").items() if a == "log"),
)
"""The rules only logged under the default ``on_alarm="warn"``: notices."""
STOPS = tuple(r for r, a in check_actions("stop", "GradFlowCallback").items() if a == "stop")
"""The rules whose alarm stops the run under ``on_alarm="stop"``."""


def death(trace: dict[str, Any]) -> tuple[int, str] | None:
    """The ground truth of a dead network, from the recorded activations: the first step after
    which some ReLU layer never fires again (no unit above 0 on any batch it ran on) to the end
    of the run, silent on at least :data:`DEATH_SILENT` steps with an input, and that layer
    (the whole layer dead); ``None``: none died (or no activations were recorded). A layer that
    gets no input (an unused branch) is not dead."""
    if "fired" not in trace:
        return None
    found: tuple[int, str] | None = None
    for column, name in enumerate(trace["relus"]):
        lit = np.flatnonzero(trace["fired"][:, column])
        start = int(lit[-1]) + 1 if lit.size else 0
        silent = int(trace["ran"][start:, column].sum())
        if silent >= DEATH_SILENT and (found is None or start < found[0]):
            found = (start, name)
    return found


def quotes_lr(message: str, lr: float) -> bool:
    """Whether ``message`` names the learning rate ``lr``: "learning rate" or "lr", then within
    a few words its value (as ``:g``, or in scientific notation), not part of a longer number.

    Example:
        >>> quotes_lr("at learning rate 0.3 the layer died", 0.3), quotes_lr("step 1", 1.0)
        (True, False)
    """
    values = "|".join(re.escape(v) for v in sorted({f"{lr:g}", f"{lr:.0e}", f"{lr:.1e}"}))
    pattern = rf"(learning rate|\blr\b)[^;.]{{0,24}}?(?<![\d.])({values})(?![\d])"
    return re.search(pattern, message) is not None


def _alarm_row(alarm: TrainingAlarm | None, lr: float) -> dict[str, Any]:
    """An alarm's step, rule and layer, and whether its message says "learning rate" (advice
    included) and names the run's learning rate (:func:`quotes_lr`)."""
    if alarm is None:
        return {"step": None, "rule": None, "layer": None, "says_lr": False, "quotes_lr": False}
    return {
        "step": alarm.step,
        "rule": alarm.rule,
        "layer": alarm.layer,
        "says_lr": "learning rate" in alarm.message.lower(),
        "quotes_lr": quotes_lr(alarm.message, lr),
        "message": alarm.message,
    }


def alarm_summary(trace: dict[str, Any], alarms: list[TrainingAlarm]) -> dict[str, Any]:
    """One run's defaults' alarms, as ``GradFlowCallback`` acts on them: notices (rules only
    logged under ``on_alarm="warn"``: *setback*, *spike*, *stall*), warnings (the rules that warn
    under it), the first warning and whether it is a *diverging*; the step and rule that would
    stop the run under ``on_alarm="stop"`` (the first alarm of a rule whose action is
    ``stop``); the loss's ground truth and the end against the family's best are the caller's."""
    run = Run(**trace["run"])
    notices = [a for a in alarms if a.rule in NOTICED]
    warnings = [a for a in alarms if a.rule in WARNED]
    stop = next((a for a in alarms if a.rule in STOPS), None)
    return {
        "run": run.name,
        "seed": run.seed,
        "family": family(run),
        "half": group(family(run)),
        "optimizer": run.optimizer,
        "lr": run.lr,
        "outlier": run.outlier_at is not None,
        "notices": len(notices),
        "notice_rules": sorted({a.rule for a in notices}),
        "warnings": len(warnings),
        "warning_rules": sorted({a.rule for a in warnings}),
        "first_warning": _alarm_row(warnings[0] if warnings else None, run.lr),
        "diverging": next((a.step for a in warnings if a.rule == "diverging"), None),
        "stop": _alarm_row(stop, run.lr),
    }


def new_families(traces: list[dict[str, Any]], rules: AlarmRules) -> dict[str, Any]:
    """The dead-network, idling and outlier families under ``rules`` (the defaults): per run,
    :func:`alarm_summary`, both labels, and for a network that died the step and layer of its
    death and the first warning from ``WITHIN`` steps before it on; totals per half."""
    kept = [t for t in traces if t["run"]["model"] in NEW_MODELS]
    best = family_bests(kept)
    dead, idle, outliers = [], [], []
    for trace in kept:
        run = Run(**trace["run"])
        alarms = replay_alarms(trace, rules)
        row = alarm_summary(trace, alarms)
        finite = np.isfinite(trace["losses"])
        row |= {
            "diverges_at": divergence_step(trace["losses"]),
            "first_nonfinite": None if finite.all() else int(np.argmin(finite)),
            "end": end_loss(trace["losses"]),
            "best": best[recipe(run)],
            "harmed": harmed(trace["losses"], best[recipe(run)]),
        }
        died = death(trace)
        row["death"] = None if died is None else died[0]
        row["dead_layer"] = None if died is None else died[1]
        if died is not None:
            after = [a for a in alarms if a.rule in WARNED and a.step >= died[0] - WITHIN]
            near = _alarm_row(after[0] if after else None, run.lr)
            row["death_warning"] = near
            row["warned_within"] = near["step"] is not None and near["step"] <= died[0] + WITHIN
        if run.model in DEAD_MODELS:
            dead.append(row)
        elif run.model in IDLE_MODELS:
            idle.append(row)
        else:
            outliers.append(row)
    return {
        "dead": {"runs": dead, **_dead_totals(dead)},
        "idle": {"runs": idle, **_healthy_totals(idle)},
        "outliers": {"runs": outliers, **_outlier_totals(outliers)},
    }


def _twins(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The healthy twins among the dead-network runs: Adam 1e-3 and SGD 0.05."""
    return [r for r in rows if (r["optimizer"], r["lr"]) in DEAD_TWINS]


def _dead_totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per half and over all: runs whose network died (with a finite loss to the end),
    warned within :data:`WITHIN` steps of death, and of those naming the learning rate; the
    runs with a non-finite loss; the healthy twins, died and warned."""
    out = {}
    for half in (*HALVES, "all"):
        kept = [r for r in rows if half in ("all", r["half"])]
        died = [r for r in kept if r["death"] is not None and r["first_nonfinite"] is None]
        within = [r for r in died if r["warned_within"]]
        twins = _twins(kept)
        out[half] = {
            "runs": len(kept),
            "died": len(died),
            "warned_within": len(within),
            "says_lr": sum(r["death_warning"]["says_lr"] for r in within),
            "quotes_lr": sum(r["death_warning"]["quotes_lr"] for r in within),
            "nonfinite": sum(r["first_nonfinite"] is not None for r in kept),
            "nonfinite_warned": sum(
                r["first_nonfinite"] is not None and r["warnings"] > 0 for r in kept
            ),
            "alive_killers": sum(r["death"] is None and r["first_nonfinite"] is None for r in kept)
            - sum(r["death"] is None and r["first_nonfinite"] is None for r in twins),
            "twins": len(twins),
            "twins_died": sum(r["death"] is not None for r in twins),
            "twins_warned": sum(r["warnings"] > 0 for r in twins),
        }
    return out


def _healthy_totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per half and over all: runs, with a notice, warned, stopped (under
    ``on_alarm="stop"``), harmed."""
    out = {}
    for half in (*HALVES, "all"):
        kept = [r for r in rows if half in ("all", r["half"])]
        out[half] = {
            "runs": len(kept),
            "noticed": sum(r["notices"] > 0 for r in kept),
            "warned": sum(r["warnings"] > 0 for r in kept),
            "stopped": sum(r["stop"]["step"] is not None for r in kept),
            "harmed": sum(r["harmed"] for r in kept),
        }
    return out


def _outlier_totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per half and over all, the runs with an outlier and their twins apart: runs, with a
    notice, warned, warned *diverging*, stopped (under ``on_alarm="stop"``), harmed, divergent
    by the loss."""
    out = {}
    for half in (*HALVES, "all"):
        for kind, odd in (("outlier", True), ("twin", False)):
            kept = [r for r in rows if half in ("all", r["half"]) and r["outlier"] == odd]
            out[f"{half}_{kind}"] = {
                "runs": len(kept),
                "noticed": sum(r["notices"] > 0 for r in kept),
                "warned": sum(r["warnings"] > 0 for r in kept),
                "diverging": sum(r["diverging"] is not None for r in kept),
                "stopped": sum(r["stop"]["step"] is not None for r in kept),
                "harmed": sum(r["harmed"] for r in kept),
                "divergent": sum(r["diverges_at"] is not None for r in kept),
            }
    return out


def _in_half(row: dict[str, Any]) -> bool:
    """Warned in the first half of its run."""
    return row["first_warning"] is not None and 2 * row["first_warning"] < row["steps"]


def confirmation_allowance(steps: int) -> int:
    """How many optimizer steps after its divergence step a warning on confirmation is still in
    time: 3, or 1% of the run's steps, whichever is more."""
    return max(CONFIRM_STEPS, math.ceil(CONFIRM_SHARE * steps))


def _confirmed_in_time(row: dict[str, Any]) -> bool:
    """Warned no later than :func:`confirmation_allowance` steps after the divergence step,
    and before the run's first non-finite loss."""
    first, at = row["first_warning"], row["diverges_at"]
    if first is None or at is None:
        return False
    nonfinite = row.get("first_nonfinite")
    return first <= at + confirmation_allowance(row["steps"]) and (
        nonfinite is None or first <= nonfinite
    )


def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    divergent = [r for r in rows if r["diverges_at"] is not None]
    healthy = [r for r in rows if r["diverges_at"] is None and not r.get("damaged")]
    leads = [
        r["diverges_at"] - r["first_warning"]
        for r in divergent
        if r["first_warning"] is not None and r["first_warning"] <= r["diverges_at"]
    ]
    lags = [r["first_warning"] - r["diverges_at"] for r in divergent if _confirmed_in_time(r)]
    collapses = [r for r in rows if r.get("kind") == "attention" and r["damaged"]]
    logits = [r for r in rows if r.get("kind") == "logits" and r["damaged"]]
    spared = [r for r in rows if r.get("damaged") is False]
    return {
        "divergent": len(divergent),
        "warned_in_time": len(leads),
        "median_lead": float(np.median(leads)) if leads else None,
        "warned_confirmed": len(lags),
        "median_lag": float(np.median(lags)) if lags else None,
        "worst_lag": max(lags) if lags else None,
        "healthy": len(healthy),
        "healthy_warned": sum(r["first_warning"] is not None for r in healthy),
        "healthy_setbacks": sum(bool(r.get("setbacks")) for r in healthy),
        "collapses": len(collapses),
        "collapses_warned": sum(_in_half(r) for r in collapses),
        "logit_damage": len(logits),
        "logit_damage_warned": sum(r["first_warning"] is not None for r in logits),
        "twin_no_better": len(spared),
        "twin_no_better_warned": sum(r["first_warning"] is not None for r in spared),
    }


def shape(losses: np.ndarray, step: int) -> str:
    """The failure's shape: ``early`` (diverged within the first 10 steps), ``drift`` (its mean
    loss still at or below the first step's loss: a slow return towards chance), else
    ``blow-up`` (after a healthy start, the loss above where it started, or not finite)."""
    if step < 10:
        return "early"
    mean = float(np.mean(losses[max(0, step - SMOOTH + 1) : step + 1]))
    return "drift" if math.isfinite(mean) and mean <= losses[0] else "blow-up"


SETBACK = "setback" if "setback" in ALARM_RULES else "transient"
"""The rule that logs a rise of the loss before it is confirmed (``transient`` in 0.2.0)."""
AT_ONCE = "lightning_hooks, every setback warned at once (diverge_patience=1)"
AT_ONCE_RULES = AlarmRules(diverge_patience=1)
"""The rules that warn a rise of the loss the step it crosses the bar: the lead the defaults'
confirmation gives up, and the healthy runs it spares."""
RULE_SETS: dict[str, Callable[[dict[str, Any]], list[int]]] = {
    "lightning_hooks, defaults": ours(AlarmRules()),
    AT_ONCE: ours(AT_ONCE_RULES),
    **PEERS,
}
SETBACKS = {"lightning_hooks, defaults": ours(AlarmRules(), (SETBACK,))}
"""The setbacks each of our rule sets logs, for the healthy runs' column."""


DEFAULTS = "lightning_hooks, defaults"


def changes(
    new: list[dict[str, Any]], old: list[dict[str, Any]], setbacks: list[bool], half: str
) -> dict[str, Any]:
    """What confirming a setback before warning (``new``, the defaults) changes against warning
    it at once (``old``) on the runs of ``half`` (``all``: every run): the lead lost on the
    divergent runs warned at once in time (steps later; median and worst over those still
    warned; and those no longer warned by their divergence step), and the healthy runs with a
    setback logged (of them: warned at once, warned on confirmation)."""
    keep = [half == "all" or group(r["family"]) == half for r in new]
    pairs = [(n, o, t) for n, o, t, k in zip(new, old, setbacks, keep, strict=True) if k]
    timely = [
        (n, o)
        for n, o, _ in pairs
        if o["diverges_at"] is not None
        and o["first_warning"] is not None
        and o["first_warning"] <= o["diverges_at"]
    ]
    later = [
        n["first_warning"] - o["first_warning"] for n, o in timely if n["first_warning"] is not None
    ]
    healthy = [(n, o) for n, o, t in pairs if t and n["diverges_at"] is None and not n["damaged"]]
    return {
        "timely_before": len(timely),
        "lead_lost_median": float(np.median(later)) if later else None,
        "lead_lost_worst": max(later) if later else None,
        "late_now": sum(
            n["first_warning"] is None or n["first_warning"] > n["diverges_at"] for n, _ in timely
        ),
        "healthy_setbacks": len(healthy),
        "setbacks_warned_at_once": sum(o["first_warning"] is not None for _, o in healthy),
        "setbacks_warned": sum(n["first_warning"] is not None for n, _ in healthy),
    }


def _subset(result: dict[str, Any], keep: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    return _totals([r for r in result["runs"] if keep(r)])


HALVES = {
    "tuning": "tuning families",
    "held_out": "held-out families",
    "fresh": "fresh held-out families, recorded after the defaults were frozen",
    "fresh2": "second fresh families, frozen and recorded after the defaults they are judged on",
}


def _half(result: dict[str, Any], half: str) -> dict[str, Any]:
    """Totals over the runs and explosions of the families of ``half`` (see :func:`group`)."""
    keep = lambda r: group(r["family"]) == half  # noqa: E731
    explosions = [r for r in result["explosions"]["runs"] if keep(r)]
    small = _subset(result, lambda r: keep(r) and r["family"] in SMALL_BATCH)
    return {**_subset(result, keep), "explosions": _explosion_totals(explosions), "small": small}


def parse_args(
    script: str,
    traces: str,
    argv: list[str] | None,
    doc: str | None,
    record: Callable[[Path], list[dict[str, Any]]] = record_all,
    missing: Callable[[Path], list[dict[str, Any]]] | None = None,
) -> tuple[argparse.Namespace, list[dict[str, Any]], float, float]:
    """The options every script on these runs takes, and the traces: recorded with ``record``
    when asked or when the file ``traces`` (under ``benchmarks/results``) is missing, else
    loaded (``missing``, when given, loads them and records the runs not in it). Returns the
    options, the traces, when the script started and how long that took.
    """
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    parser.add_argument("--record", action="store_true", help="record the traces again")
    parser.add_argument("--traces", default=str(RESULTS / f"{traces}.pt"))
    parser.add_argument("--out", default=str(RESULTS / script))
    parser.add_argument(
        "--quick",
        action="store_true",
        help="record only the missing runs quick on a CPU (QUICK: the digits, tabular and "
        "character-level models, and the dead-network, idling and outlier families); replay "
        "the traces there are",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    path = Path(args.traces)
    if args.quick:  # the quick runs missing recorded, every other trace kept as it is
        loaded = record_all(path, runs=quick_runs, again=False)
    elif args.record or not path.exists():
        loaded = record(path)
    elif missing is not None:
        loaded = missing(path)
    else:
        loaded = torch.load(path, weights_only=False)
    return args, loaded, started, time.perf_counter() - started


def result_header(
    script: str, argv: list[str] | None, started: float, recorded: float
) -> dict[str, Any]:
    """What every saved result starts with: the command, torch, the runs and the defaults."""
    return {
        "command": f"PYTHONPATH=$PWD python benchmarks/{script}.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "steps": STEPS,
        "seeds": SEEDS,
        "held_out_seeds": HELD_OUT,
        "held_out_families": sorted(HELD_OUT_FAMILIES),
        "fresh_families": sorted(FRESH_FAMILIES),
        "fresh2_families": sorted(FRESH2_MODELS),
        "record_s": recorded,
        "wall_s": time.perf_counter() - started,
        "defaults": asdict(AlarmRules()),
    }


def all_traces(
    script: str, argv: list[str] | None, doc: str | None
) -> tuple[argparse.Namespace, list[dict[str, Any]], float, float]:
    """:func:`parse_args` over the traces of :func:`all_runs`, recording those missing."""
    recorder = partial(record_all, runs=all_runs)
    missing = partial(recorder, again=False)
    return parse_args(script, "divergence_traces", argv, doc, recorder, missing)


def main(argv: list[str] | None = None) -> None:
    """Replay every rule set on the traces; write the results (``--out``: .json and .md).

    The main replay's tables (the runs of :func:`all_runs` but those of :data:`NEW_MODELS`)
    are written again only when every one of its runs is in the traces; else (``--quick`` on a
    machine without the costly traces) they are kept from the saved result, and only the
    sections of :func:`new_markdown` are replaced.
    """
    args, traces, started, recorded = all_traces("divergence", argv, __doc__)
    wanted = {_run_key(asdict(run)) for run in all_runs()}
    traces = [t for t in traces if _run_key(t["run"]) in wanted]
    present = {_run_key(t["run"]) for t in traces}
    missing = [r for r in all_runs() if _run_key(asdict(r)) not in present]
    complete = not [r for r in missing if r.model not in NEW_MODELS]
    added = {family(r) for r in new_runs()}
    shaped = shapes(traces)
    results: dict[str, Any] = {}
    labels: dict[str, Any] = {}
    labelled: list[dict[str, Any]] = []
    for name, replay in RULE_SETS.items():
        scored = score(traces, replay, SETBACKS.get(name), every=True)
        rows = scored["runs"]
        main_rows = [r for r in rows if r["family"] not in added]
        labelled = [{k: r[k] for k in _LABEL_KEYS} for r in rows]  # the same for every set
        labels[name] = {
            "halves": label_halves(rows),
            "main": label_halves(main_rows),
            "new": label_halves([r for r in rows if r["family"] in added]),
            "first_warning": [r["first_warning"] for r in rows],  # in the order of label_runs
        }
        if complete:
            result = {"runs": main_rows, **_totals(main_rows)}
            result["explosions"] = score_explosions(traces, replay)
            result["halves"] = {half: _half(result, half) for half in HALVES}
            result["by_shape"] = {
                kind: _subset(result, lambda r, k=kind: shaped.get((r["run"], r["seed"])) == k)
                for kind in ("early", "blow-up", "drift")
            }
            results[name] = result
        print(f"{time.perf_counter() - started:5.0f}s replayed {name}", file=sys.stderr)
    target = Path(args.out)
    header = result_header("divergence", argv, started, recorded)
    news = {
        "labels": labels,
        "new_families": new_families(traces, AlarmRules()),
        "new_held_out_families": sorted(NEW_HELD_OUT),
        "new_fresh_families": sorted(NEW_FRESH),
        "fresh2_families": sorted(FRESH2_MODELS),
        "label_runs": labelled,
        "labelled": {
            "command": header["command"],
            "torch": torch.__version__,
            "runs": len(traces),
            "missing_runs": len(missing),
            "missing_families": sorted({family(r) for r in missing}),
            "complete": complete,
            "wall_s": time.perf_counter() - started,
        },
    }
    if complete:
        new = results[DEFAULTS]["runs"]
        old = results[AT_ONCE]["runs"]
        logged = [bool(r["setbacks"]) for r in new]
        out = {
            **header,
            "shapes": {f"{run}, seed {seed}": kind for (run, seed), kind in shaped.items()},
            "rule_sets": results,
            "changes": {half: changes(new, old, logged, half) for half in (*HALVES, "all")},
        }
        text = markdown(out)
    else:  # the main replay's tables as saved
        out = json.loads(target.with_suffix(".json").read_text())
        text = target.with_suffix(".md").read_text().split(NEW_SECTIONS)[0].rstrip("\n") + "\n"
        saved = out["rule_sets"][DEFAULTS]["runs"]
        news["labelled"]["differ_from_saved"] = differ(saved, labelled, labels[DEFAULTS])
    out |= news
    text += new_markdown(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    target.with_suffix(".md").write_text(text)
    print(new_markdown(out))


_LABEL_KEYS = ("run", "seed", "family", "diverges_at", "damaged", "end", "harmed")


def differ(
    saved: list[dict[str, Any]], rows: list[dict[str, Any]], ours: dict[str, Any]
) -> dict[str, Any]:
    """The runs of the saved main replay (``saved``: the defaults' rows) that are in ``rows``
    (with ``ours``: the defaults' first warnings), and those whose divergence step or first
    warning differs: traces recorded elsewhere differ in the last bits, and a run at
    the edge of stability takes another path."""
    kept = {(r["run"], r["seed"]): r for r in saved}
    common = [
        (r, first)
        for r, first in zip(rows, ours["first_warning"], strict=True)
        if (r["run"], r["seed"]) in kept
    ]
    other = [
        f"{r['run']}, seed {r['seed']}"
        for r, first in common
        if (
            kept[(r["run"], r["seed"])]["first_warning"],
            kept[(r["run"], r["seed"])]["diverges_at"],
        )
        != (first, r["diverges_at"])
    ]
    return {"common": len(common), "runs": other}


def shapes(traces: list[dict[str, Any]]) -> dict[tuple[str, int], str]:
    """The shape (:func:`shape`) of each divergent run of ``traces``, by name and seed."""
    found = {}
    for t in traces:
        step = divergence_step(t["losses"])
        if step is not None and t["run"]["model"] not in NEW_MODELS:
            found[(Run(**t["run"]).name, t["run"]["seed"])] = shape(t["losses"], step)
    return found


def _cells(t: dict[str, Any]) -> str:
    lead = "-" if t["median_lead"] is None else f"{t['median_lead']:g}"
    warned = f"{t['warned_in_time']} of {t['divergent']}"
    return f"{warned} | {lead} | {t['healthy_warned']} of {t['healthy']}"


def _lag(r: dict[str, Any]) -> str:
    """The lag behind the divergence step of the runs warned in time on confirmation: median,
    worst."""
    if r["median_lag"] is None:
        return "-"
    return f"{r['median_lag']:g}, {r['worst_lag']}"


def main_cells(r: dict[str, Any]) -> str:
    """Divergent warned by their divergence step, warned in time on confirmation, its lag,
    damaging explosions warned at their step, harmless ones warned, damaging attention
    collapses warned in the first half of the run, healthy runs warned."""
    e = r["explosions"]
    return (
        f"{r['warned_in_time']} of {r['divergent']} | {r['warned_confirmed']} of "
        f"{r['divergent']} | {_lag(r)} | {e['damaging_warned']} of {e['damaging']} | "
        f"{e['harmless_warned']} of {e['harmless']} | {r['collapses_warned']} of "
        f"{r['collapses']} | {r['healthy_warned']} of {r['healthy']} |"
    )


MAIN_HEADER = (
    "| rule set | divergent runs warned by their divergence step | divergent runs warned in "
    "time on confirmation | lag behind the divergence step: median, worst "
    "| damaging explosions warned at their step "
    "| harmless explosions warned | damaging attention collapses warned in the first half "
    "| healthy runs warned |"
)
MAIN_RULE = "| --- " * 8 + "|"


def markdown(out: dict[str, Any]) -> str:
    sets = out["rule_sets"]
    first = next(iter(sets.values()))
    lines = [
        f"{len(first['runs'])} runs and {len(first['explosions']['runs'])} one-step gradient "
        f"explosions (x{', x'.join(f'{x:g}' for x in EXPLODE_SIZES)}, at step "
        f"{' or '.join(str(a) for a in EXPLODE_AT.values())}, each against its twin run); "
        "every rule set replayed on the same traces. Divergent runs warned at or before the "
        "step the loss diverged, and warned in time on confirmation: no later than "
        f"{CONFIRM_STEPS} steps or {CONFIRM_SHARE:.0%} of the run (whichever is more) after that "
        "step and before the first non-finite loss; damaging explosions (the loss "
        f"{DAMAGE_WINDOW[0]}-{DAMAGE_WINDOW[1]} steps later above {DAMAGE_RATIO:g}x the twin's "
        f"+ {DAMAGE_MARGIN:g}x the twin's first loss, or not finite) warned at their step; "
        "damaging attention collapses (a GPT without qk-layernorm whose last "
        f"{FINAL} steps' loss is above {TWIN_RATIO:g}x its qk-layernorm twin's + "
        f"{DAMAGE_MARGIN:g}x the twin's first loss) warned in the first half of the run; "
        "harmless explosions and healthy runs with any warning.",
    ]
    for half, title in HALVES.items():
        families = sorted({r["family"] for r in first["runs"] if group(r["family"]) == half})
        lines += ["", f"**{title.capitalize()}** ({', '.join(families)}):", ""]
        lines += [MAIN_HEADER, MAIN_RULE]
        lines += [f"| {name} | {main_cells(r['halves'][half])}" for name, r in sets.items()]
        ours = sets[DEFAULTS]["halves"][half]
        small = ours["small"]
        lines += [
            "",
            f"Healthy runs with a setback logged (defaults): {ours['healthy_setbacks']} of "
            f"{ours['healthy']}. The small-batch and fine-tuning families alone (defaults): "
            f"{small['healthy_warned']} of {small['healthy']} healthy runs warned, "
            f"{small['warned_confirmed']} of {small['divergent']} divergent runs warned in time "
            "on confirmation.",
        ]
    lines += ["", "**All runs**:", "", MAIN_HEADER, MAIN_RULE]
    lines += [f"| {name} | {main_cells(r)}" for name, r in sets.items()]
    lines += [
        "",
        "What confirming a setback before warning (the defaults) changes against warning it "
        "the step it crosses the bar (diverge_patience=1): the divergent runs warned at once by "
        "their divergence step, how many steps later the defaults warn them (median, worst) and "
        "how many are then after their divergence step or not warned; the healthy runs where "
        "the defaults log a *setback*, and of them those warned at once and on confirmation:",
        "",
        "| runs | divergent, warned at once by their divergence step | steps later: median | "
        "worst | then after it | healthy runs with a setback logged | warned at once | "
        "warned on confirmation |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for half, c in out["changes"].items():
        lost = [c["lead_lost_median"], c["lead_lost_worst"]]
        median, worst = ("-" if v is None else f"{v:g}" for v in lost)
        lines.append(
            f"| {HALVES.get(half, 'every run')} | {c['timely_before']} | {median} | {worst} | "
            f"{c['late_now']} | {c['healthy_setbacks']} | {c['setbacks_warned_at_once']} | "
            f"{c['setbacks_warned']} |"
        )
    lines += [
        "",
        "The families judged against a twin (defaults): damaging output-logit drifts (a GPT "
        "without z-loss, worse than its z-loss twin) warned, and runs whose twin is no better "
        "warned:",
        "",
        "| rule set | output-logit damage warned | twin no better, warned |",
        "| --- | --- | --- |",
    ]
    lines += [
        f"| {name} | {r['logit_damage_warned']} of {r['logit_damage']} | "
        f"{r['twin_no_better_warned']} of {r['twin_no_better']} |"
        for name, r in sets.items()
    ]
    lines += [
        "",
        "By the shape of the failure (divergent runs: warned in time, median lead in steps over "
        "those warned in time; no lead target):",
        "",
        "| rule set | early blow-up (< 10 steps) | blow-up after a healthy start | slow drift |",
        "| --- | --- | --- | --- |",
    ]
    for name, r in sets.items():
        cells = []
        for kind in ("early", "blow-up", "drift"):
            t = r["by_shape"][kind]
            lead = "-" if t["median_lead"] is None else f"{t['median_lead']:g}"
            cells.append(f"{t['warned_in_time']} of {t['divergent']}, lead {lead}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Per explosion (ground truth against the twin; the defaults):", ""]
    lines += [
        "| run | seed | ground truth | warned at its step | first warning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in sets[DEFAULTS]["explosions"]["runs"]:
        truth = "damaging" if row["damaging"] else "harmless"
        first = "-" if row["first_warning"] is None else row["first_warning"]
        lines.append(
            f"| {row['run']} | {row['seed']} | {truth} | "
            f"{'yes' if row['warned_at_step'] else 'no'} | {first} |"
        )
    lines += ["", "Per run (ground truth; first warning of the defaults):", ""]
    lines += [
        "| run | seed | family | diverges at | shape | first warning |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in sets[DEFAULTS]["runs"]:
        kind = out["shapes"].get(f"{row['run']}, seed {row['seed']}", "healthy")
        if row["damaged"] is not None:
            kind += f"; {'worse than' if row['damaged'] else 'no worse than'} its twin"
        at = "-" if row["diverges_at"] is None else row["diverges_at"]
        first = "-" if row["first_warning"] is None else row["first_warning"]
        held = {"tuning": "tuning", "held_out": "held out", "fresh": "fresh", "fresh2": "fresh2"}[
            group(row["family"])
        ]
        lines.append(
            f"| {row['run']} | {row['seed']} | {row['family']} ({held}) | {at} | {kind} | {first} |"
        )
    return "\n".join(lines) + "\n"


# --- the tables of both labels, dead networks, idling layers and outlier batches --------------

NEW_SECTIONS = "## Judged by how the run ends"
"""The heading the sections of :func:`new_markdown` start at (the saved ``.md`` is cut there
when the main replay's tables are kept)."""


def _provenance(done: dict[str, Any]) -> list[str]:
    """When the main replay's tables above were kept from the saved result: say so, and how
    far the traces replayed here agree with the saved runs."""
    if done.get("complete", True):
        return []
    other = done["differ_from_saved"]
    return [
        "",
        "The main replay's tables above are the saved result (their traces, recorded "
        "elsewhere, are not here); the sections below replay the traces recorded here. "
        f"Of the {other['common']} runs in both, {len(other['runs'])} differ in the defaults' "
        "first warning or the divergence step (runs at the edge of stability, which take "
        f"another path from the last bits): {'; '.join(other['runs']) or 'none'}.",
    ]


def _precision(t: dict[str, Any]) -> str:
    return "-" if t["precision"] is None else f"{t['precision']:.0%}"


def _label_cells(t: dict[str, Any]) -> str:
    """Warned; of them harmed or divergent (precision); warned that the old label calls healthy;
    warned that the new one calls unharmed; harmed or divergent runs warned."""
    return (
        f"{t['warned']} | {t['warned_bad']} ({_precision(t)}) | {t['warned_old_healthy']} | "
        f"{t['warned_unharmed']} | {t['bad_warned']} of {t['bad']} |"
    )


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def new_markdown(out: dict[str, Any]) -> str:
    """The sections on both labels (precision per half, every rule set), the dead networks, the
    healthy runs whose layers idle and the outlier batches (the defaults)."""
    labels = out["labels"]
    done = out["labelled"]
    missing = ", ".join(done["missing_families"]) or "none"
    lines = [
        "",
        NEW_SECTIONS,
        "",
        f"Replayed: {done['runs']} runs (explosions included), every rule set on the same "
        f"traces; runs of `all_runs()` not in the traces: {done['missing_runs']} (families: "
        f"{missing}). Command: `{done['command']}`.",
        *_provenance(done),
        "",
        "Two labels. The old one, from the loss alone: a run is divergent at "
        "`divergence_step`, else healthy (a GPT worse than its twin is neither). The new one, "
        "from how the run ends: a run is *harmed* when the mean of its last "
        f"{TAIL} training losses is above max({HARM_RATIO:g} x its family's best such mean, "
        f"the best + {HARM_MARGIN:g}) (or not finite). Its family (`recipe`): the same model "
        "(so the same data), optimizer, schedule, clipping, z-loss, length, batch and "
        "accumulation, at any learning rate or seed, without the injected event (an outlier "
        "batch's run is judged against its family without it). A warning is false by the new "
        "label when the run is neither harmed nor divergent. Precision: of the warned runs, "
        "the share harmed or divergent.",
        "",
        "The held-out half of the new families (frozen before any rule was tuned on them): "
        + ", ".join(f"`{f}`" for f in out["new_held_out_families"])
        + ". The fresh half adds quick families of new models, data and recipes, frozen and "
        "recorded before the rule for outlier batches under SGD with momentum was judged on "
        "them, replayed with the main families, and four outlier families recorded before the "
        "rule for an outlier the loss falls back from was judged on them: "
        + ", ".join(f"`{f}`" for f in out.get("new_fresh_families", []))
        + ". The tuning half adds two outlier families on SGD with momentum: "
        "`outlier-bnmlp-cancer`, `outlier-bncnn-cancer`. The second fresh half (`fresh2`), "
        "quick families of new models, data and recipes frozen and recorded before the change "
        "to the loss rule it judges, and before any of its results was looked at: "
        + ", ".join(f"`{f}`" for f in out.get("fresh2_families", []))
        + ".",
    ]
    head = (
        "| rule set | runs warned | of them harmed or divergent (precision) | warned, healthy "
        "by the old label | warned, unharmed by the new label (false) | harmed or divergent "
        "runs warned |"
    )
    first = next(iter(labels.values()))["halves"]
    for half in (*HALVES, "all"):
        t = first[half]
        title = HALVES.get(half, "every run replayed")
        lines += [
            "",
            f"**Both labels, {title}** ({t['runs']} runs: {t['divergent']} divergent, "
            f"{t['harmed']} harmed, {t['bad']} harmed or divergent):",
            "",
            head,
            "| --- " * 6 + "|",
        ]
        lines += [f"| {name} | {_label_cells(r['halves'][half])}" for name, r in labels.items()]
    lines += [
        "",
        "The defaults by part (main replay's families replayed here; the new families):",
        "",
        "| part | half | runs | harmed or divergent | " + head.split("| ", 2)[2],
        "| --- " * 9 + "|",
    ]
    ours = labels[DEFAULTS]
    for part in ("main", "new"):
        for half in (*HALVES, "all"):
            t = ours[part][half]
            if t["runs"]:
                lines.append(f"| {part} | {half} | {t['runs']} | {t['bad']} | {_label_cells(t)}")
    lines += _dead_lines(out["new_families"]["dead"])
    lines += _idle_lines(out["new_families"]["idle"])
    lines += _outlier_lines(out["new_families"]["outliers"])
    return "\n".join(lines) + "\n"


def _dead_lines(dead: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "### Dead networks (the defaults)",
        "",
        "Death, from the recorded activations (`death`): the first step after which a ReLU "
        f"layer never fires again (no unit above 0 on any batch, at least {DEATH_SILENT} "
        "steps with an input to the end): the whole layer dead. Warned in time: a warning "
        f'(a rule that warns under `on_alarm="warn"`) no later than {WITHIN} optimizer '
        f"steps after the death (the first from {WITHIN} steps before it). Its message says "
        '"learning rate" (the advice "lower the learning rate" counts), and names the run\'s '
        'learning rate ("learning rate" or "lr", then its value). Runs whose loss turned '
        "non-finite are apart.",
        "",
        "| half | runs | died (finite loss) | warned within 10 steps | of them saying "
        '"learning rate" (advice included) | naming the run\'s learning rate | non-finite '
        "loss | of them warned | killer runs alive | healthy twins | twins died | twins warned |",
        "| --- " * 12 + "|",
    ]
    for half in (*HALVES, "all"):
        t = dead[half]
        if t["runs"]:
            lines.append(
                f"| {half} | {t['runs']} | {t['died']} | {t['warned_within']} | {t['says_lr']} "
                f"| {t['quotes_lr']} | {t['nonfinite']} | {t['nonfinite_warned']} | "
                f"{t['alive_killers']} | {t['twins']} | {t['twins_died']} | {t['twins_warned']} |"
            )
    lines += [
        "",
        "| run | seed | family (half) | death: step, layer | non-finite from | first warning "
        'from death - 10: step, rule | within 10 | says "learning rate" | names the lr | '
        "warnings (rules) | harmed | divergent at |",
        "| --- " * 12 + "|",
    ]
    for r in dead["runs"]:
        died = "-" if r["death"] is None else f"{r['death']}, {r['dead_layer']}"
        near = r.get("death_warning")
        first = "-" if near is None or near["step"] is None else f"{near['step']}, {near['rule']}"
        within = "-" if near is None else _yes(r["warned_within"])
        says = "-" if near is None or near["step"] is None else _yes(near["says_lr"])
        quotes = "-" if near is None or near["step"] is None else _yes(near["quotes_lr"])
        rules = ", ".join(r["warning_rules"]) or "-"
        lines.append(
            f"| {r['run']} | {r['seed']} | {r['family']} ({r['half']}) | {died} | "
            f"{_dash(r['first_nonfinite'])} | {first} | {within} | {says} | {quotes} | "
            f"{r['warnings']} ({rules}) | {_yes(r['harmed'])} | {_dash(r['diverges_at'])} |"
        )
    return lines


def _idle_lines(idle: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "### Healthy runs whose layers idle (the defaults)",
        "",
        "A backbone frozen for the first 200 steps, a branch unused from step 100, a mixture "
        "of experts whose experts idle (steps 100-200 forced; others by the router). Any "
        'warning is false; a stop is under `on_alarm="stop"`. A layer that got no gradient '
        "is the notice `no_gradient`.",
        "",
        "| half | runs | with a notice | warned | stopped | harmed |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for half in (*HALVES, "all"):
        t = idle[half]
        if t["runs"]:
            lines.append(
                f"| {half} | {t['runs']} | {t.get('noticed', '-')} | {t['warned']} | "
                f"{t['stopped']} | {t['harmed']} |"
            )
    lines += [
        "",
        "| run | seed | family (half) | notices (rules) | warnings (rules), first | "
        "stop: step, rule | death | harmed |",
        "| --- " * 8 + "|",
    ]
    for r in idle["runs"]:
        noticed, warned, stop = _alarm_cells(r)
        lines.append(
            f"| {r['run']} | {r['seed']} | {r['family']} ({r['half']}) | {noticed} | {warned} | "
            f"{stop} | {_dash(r['death'])} | {_yes(r['harmed'])} |"
        )
    return lines


def _alarm_cells(run: dict[str, Any]) -> tuple[str, str, str]:
    """Write a run's notices, warnings and stop as the cells of a table row.

    Args:
        run: one run's record of the replay.

    Returns:
        The notices with their rules, the warnings with their rules and first step, and the
        stop's step and rule (``-`` where none).
    """
    noticed = f"{run['notices']} ({', '.join(run['notice_rules']) or '-'})"
    rules = ", ".join(run["warning_rules"]) or "-"
    warned = f"{run['warnings']} ({rules}), {_dash(run['first_warning']['step'])}"
    stop = run["stop"]
    stopped = "-" if stop["step"] is None else f"{stop['step']}, {stop['rule']}"
    return noticed, warned, stopped


def _outlier_lines(outliers: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "### Outlier batches (the defaults)",
        "",
        f"At step {OUTLIER_AT}: the step's loss x10 or x30 (its gradient too), or its labels "
        "(one step, or two consecutive) shifted by one class; each run with its twin without "
        'it. Notices: rules only logged under the default `on_alarm="warn"` '
        f"({', '.join(NOTICED)}); warnings: the rules that warn ({', '.join(WARNED)}); stops: "
        f'the first alarm of a rule that stops under `on_alarm="stop"` '
        f"({', '.join(STOPS)}). A healthy run: any *diverging* or stop is a false alarm.",
        "",
        "| half | runs | with a notice | warned | warned *diverging* | stopped | harmed | "
        "divergent by the loss |",
        "| --- " * 8 + "|",
    ]
    for key, t in outliers.items():
        if isinstance(t, dict) and t["runs"]:
            lines.append(
                f"| {key.replace('_outlier', ', outlier').replace('_twin', ', twin')} | "
                f"{t['runs']} | {t['noticed']} | {t['warned']} | {t['diverging']} | "
                f"{t['stopped']} | {t['harmed']} | {t['divergent']} |"
            )
    lines += [
        "",
        "| run | seed | family (half) | notices (rules) | warnings (rules), first | diverging "
        "at | stop: step, rule | harmed (end vs best) | divergent at |",
        "| --- " * 9 + "|",
    ]
    for r in outliers["runs"]:
        notices, warned, stop = _alarm_cells(r)
        lines.append(
            f"| {r['run']} | {r['seed']} | {r['family']} ({r['half']}) | {notices} | {warned} | "
            f"{_dash(r['diverging'])} | {stop} | {_yes(r['harmed'])} ({r['end']:.3g} vs "
            f"{r['best']:.3g}) | {_dash(r['diverges_at'])} |"
        )
    return lines


if __name__ == "__main__":
    main()
