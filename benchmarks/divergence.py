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

Each step records what the sentinel reads (per-layer gradient L2 norms and the global one, before
clipping and the optimizer step), the training loss, the LR and the typical update (what the
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

Usage::

    PYTHONPATH=$PWD python benchmarks/divergence.py            # record (if needed) and replay
    PYTHONPATH=$PWD python benchmarks/divergence.py --record   # record the traces again
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import families
import numpy as np
import torch
from torch import nn

from lightning_hooks.callbacks.alarm_policy import check_actions
from lightning_hooks.core import AlarmRules, ParamLayout, TrainingAlarms
from lightning_hooks.core.alarms import ALARM_RULES
from lightning_hooks.core.ops.grad_stats import param_norms, segment_norm
from lightning_hooks.core.ops.grouped_norms import typical_update
from lightning_hooks.core.stats.stability import StabilityStats

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STEPS = 300
SMOOTH = 5  # steps in the ground truth's mean loss
SEEDS = (0, 1, 2)
HELD_OUT = (2,)  # seeds not looked at while the defaults were chosen
ADAPTIVE = ("adam", "adamw", "rmsprop", "adamw95")  # the optimizers with a second moment
LOG_EVERY = 50  # the Trainer's log_every_n_steps: the callback's logging steps
DAMAGE_WINDOW = (50, 100)  # steps after an explosion where its loss is compared with the twin's
# "clearly worse": this ratio, and above it by this share of the twin's first loss (the loss's
# scale: 0.046 on the 10-class sets, whose first loss is ln 10; 0.014 on a 2-class one)
DAMAGE_RATIO, DAMAGE_MARGIN = 1.25, 0.02
_SEQ, _VOCAB = 32, 96
WARNED = tuple(rule for rule, action in check_actions("warn").items() if action == "warn")
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
    optimizer: str  # sgd (momentum 0.9, 0 on the LSTM), nesterov, adam, adamw, rmsprop
    lr: float
    # "ramp": linear from 0 to ``lr`` over the run; "cosine": 10% linear warm-up, then cosine
    # decay to 0 at the last step; "onecycle": torch's OneCycleLR (cosine, pct_start 0.3);
    # "step": x0.1 at half the run, x0.01 at three quarters; "linear": 10% linear warm-up, then
    # linear decay to 0
    schedule: str = "constant"
    seed: int = 0
    clip: float | None = None  # clip_grad_norm_ before the step
    explode_at: int | None = None
    explode: float = 1.0
    steps: int = STEPS
    zloss: float = 0.0  # z-loss: this times the mean squared log-partition of the output logits
    batch: int | None = None  # examples per micro-batch (None: 32 rows, 16 windows of text)
    accum: int = 1  # micro-batches per optimizer step (``accumulate_grad_batches``)

    @property
    def name(self) -> str:
        sched = "" if self.schedule == "constant" else f", {self.schedule}"
        clip = "" if self.clip is None else f", clip {self.clip:g}"
        boom = "" if self.explode_at is None else f", x{self.explode:g} at {self.explode_at}"
        zloss = "" if not self.zloss else f", z-loss {self.zloss:g}"
        steps = "" if self.steps == STEPS else f", {self.steps} steps"
        batch = "" if self.batch is None else f", batch {self.batch}"
        accum = "" if self.accum == 1 else f" x {self.accum}"
        return (
            f"{self.model}, {self.optimizer} {self.lr:g}{sched}{clip}{zloss}{steps}{batch}"
            f"{accum}{boom}"
        )

    @property
    def twin(self) -> Run:
        """The same run without the explosion."""
        return replace(self, explode_at=None, explode=1.0)

    def lr_at(self, step: int) -> float:  # noqa: PLR0911 (one return per schedule)
        """The learning rate of optimizer step ``step``."""
        last = self.steps - 1
        t = step / last
        if self.schedule == "step":  # x0.1 at half the run, x0.01 at three quarters
            return self.lr * (1.0 if t < 0.5 else 0.1 if t < 0.75 else 0.01)
        warm = self.steps // 10
        if self.schedule in ("linear", "cosine") and step < warm:
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
"""Recorded after the defaults were frozen: a residual MLP with LayerNorm on the wine set, a
batch of 4, Adam with a step schedule (transients and small noisy batches at once); a
pretrained byte GRU fine-tuned whole on the documents of :data:`MIXED` at a micro-batch of 1,
and of 2 with accumulation over 8."""

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


def family(run: Run) -> str:
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
FRESH_FAMILIES = frozenset({"gpt-deep", "gpt-6h", "resmlp-wine", "ft-gru-mix"})
"""Families recorded only after the defaults they are judged on were frozen: a half no
default has seen. Reported apart from both halves."""


SMALL_BATCH = frozenset(
    {"wine-sgd", "wine-adam", "resmlp-wine", "ft", "ft-lora", "ft-mix-mb1", "ft-mix-accum"}
    | {"ft-mix-lora", "ft-gru-mix"}
)
"""The small-batch and fine-tuning families: micro-batches of 1-4, with or without
accumulation, where the loss swings most from one micro-batch to the next."""


def group(name: str) -> str:
    """The half a family is reported in: ``tuning``, ``held_out`` or ``fresh``."""
    return (
        "fresh" if name in FRESH_FAMILIES else "held_out" if name in HELD_OUT_FAMILIES else "tuning"
    )


def _optimizer(run: Run, model: nn.Module) -> torch.optim.Optimizer:
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
    if run.model.startswith("ft"):  # a fine-tune: the trainable parameters only
        params = (p for p in model.parameters() if p.requires_grad)
    if run.optimizer == "adamw95":  # Wortsman et al.'s AdamW: independent weight decay 1e-4
        return torch.optim.AdamW(params, lr=run.lr, betas=(0.9, 0.95), weight_decay=1e-4 / run.lr)
    return torch.optim.Adam(params, lr=run.lr)


def _batches(run: Run, gen: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    if run.model in (
        "mlp",
        "mlp6",
        "cnn",
        "resmlp",
        "cnn-m",
        "bnmlp",
        "resmlp-digits",
        "wine",
        "resmlp-wine",
    ):
        x, y = {"resmlp": _cancer, "wine": _wine, "resmlp-wine": _wine}.get(run.model, _digits)()
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
    for step in range(run.steps):
        for group in opt.param_groups:
            group["lr"] = run.lr_at(step)
        opt.zero_grad()
        micro = []
        for _ in range(run.accum):  # Lightning's accumulation: each micro-batch's loss / accum
            x, y = next(batches)
            out = model(x)
            logits = out.reshape(-1, out.shape[-1])
            loss = nn.functional.cross_entropy(logits, y.reshape(-1))
            if run.zloss:
                loss = loss + run.zloss * torch.logsumexp(logits, -1).square().mean()
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


def grad_norms(layout: ParamLayout) -> np.ndarray:
    """Per-layer gradient L2 norms, then the global one (a parameter without a gradient: 0)."""
    grads = [p.grad if p.grad is not None else p.new_zeros(1) for p in layout.params]
    with torch.no_grad():
        return segment_norm(param_norms(grads), layout.index, len(layout.layers)).numpy().copy()


def record(run: Run) -> dict[str, Any]:
    """Train ``run`` and record what the sentinel reads each step: per-layer gradient norms (then
    the global one) and the loss; also the weight norms, for rules that want them."""
    norms, weights, losses, updates, micro = [], [], [], [], []
    layers: list[str] = []
    last: list[torch.Tensor] | None = None
    grads: list[torch.Tensor | None] = []
    probe = _StabilityProbe() if run.model.startswith(("gpt", "ft")) else None
    for step, (model, layout, _, loss) in enumerate(train(run, probe and probe.attach)):
        if probe is not None:
            probe.step(step)
        layers = layout.layers
        norms.append(grad_norms(layout))
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
            self.windows.append(got)
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
        for run in (*TRANSIENTS, *COLLAPSES, *FINE_TUNING, *FINE_TUNING_MIXED, *FRESH_RUNS)
    ]
    return runs


def record_all(
    path: Path,
    record: Callable[[Run], dict[str, Any]] = record,
    runs: Callable[[], list[Run]] | None = None,
    again: bool = True,
) -> list[dict[str, Any]]:
    """Every run of ``runs()`` (default: the sweep on every seed), recorded by
    ``record`` and saved to ``path``; with ``again=False``, the runs already in ``path`` are
    kept and only the missing ones recorded."""
    started = time.perf_counter()
    todo = runs() if runs is not None else [replace(r, seed=s) for s in SEEDS for r in SWEEP]
    kept = {} if again or not path.exists() else _by_run(torch.load(path, weights_only=False))
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
    """This library's sentinel at ``rules``: the steps of its alarms of the ``warn`` rules (by
    default, those that warn under ``GradFlowCallback``'s default ``on_alarm="warn"``), fed
    as the callback feeds it: the pre-clip norms and the clip every step; on the logging steps
    (every ``LOG_EVERY``) the typical update and the learning rate, and the attention
    statistics ``StabilityStats`` measured."""

    def replay(trace: dict[str, Any]) -> list[int]:
        alarms = TrainingAlarms(trace["layers"], rules)
        clip = trace["run"].get("clip")
        # the callback reads the stall on optimizers with a second moment (traces recorded
        # before the updates were carry none)
        adaptive = trace["run"]["optimizer"] in ADAPTIVE
        stall = adaptive and "updates" in trace
        windows = dict(trace.get("stability", []))
        alarms.set_adaptive(adaptive)  # as GradFlowTracker.observe sets it from the optimizer
        found = []
        # with accumulation, the callback reads every micro-batch's loss
        losses = trace.get("micro_losses", trace["losses"][:, None])
        for step, (norm, micro) in enumerate(zip(trace["norms"], losses, strict=True)):
            alarms.update(torch.from_numpy(norm).float(), step=step, clip=clip)
            for loss in micro:
                alarms.update_loss(torch.tensor(loss, dtype=torch.float32), step=step)
            if logging_step(step) and stall:
                update = torch.tensor(trace["updates"][step], dtype=torch.float32)
                alarms.update_stall(update, float(trace["lrs"][step]), step=step)
            if step in windows:
                attn = windows[step]
                alarms.update_attention(attn["attn_logit_max"], attn["attn_entropy_min"], step=step)
            found += [a.step for a in alarms.poll() if a.rule in warn]
        return found

    return replay


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
) -> dict[str, Any]:
    """Per run without an explosion: its family, the divergence step, the damage against a twin
    (``None``: no twin), the first warning and (``setbacks``: their replay) the setbacks
    logged; totals."""
    by_key = {_key(t["run"]): t for t in traces if t["run"].get("explode_at") is None}
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
            }
        )
    return {"runs": rows, **_totals(rows)}


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
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    path = Path(args.traces)
    if args.record or not path.exists():
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
    args, traces, started, recorded = all_traces("divergence", argv, __doc__)
    shapes = {
        (Run(**t["run"]).name, t["run"]["seed"]): shape(t["losses"], step)
        for t in traces
        if (step := divergence_step(t["losses"])) is not None
    }
    results: dict[str, Any] = {}
    for name, replay in RULE_SETS.items():
        result = score(traces, replay, SETBACKS.get(name))
        result["explosions"] = score_explosions(traces, replay)
        result["halves"] = {half: _half(result, half) for half in HALVES}
        result["by_shape"] = {
            kind: _subset(result, lambda r, k=kind: shapes.get((r["run"], r["seed"])) == k)
            for kind in ("early", "blow-up", "drift")
        }
        results[name] = result
        print(f"{time.perf_counter() - started:5.0f}s replayed {name}", file=sys.stderr)
    new, old = results[DEFAULTS]["runs"], results[AT_ONCE]["runs"]
    logged = [bool(r["setbacks"]) for r in new]
    out = {
        **result_header("divergence", argv, started, recorded),
        "shapes": {f"{run}, seed {seed}": kind for (run, seed), kind in shapes.items()},
        "rule_sets": results,
        "changes": {half: changes(new, old, logged, half) for half in (*HALVES, "all")},
    }
    target = Path(args.out)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    target.with_suffix(".md").write_text(markdown(out))
    print(markdown(out))


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
        held = {"tuning": "tuning", "held_out": "held out", "fresh": "fresh"}[group(row["family"])]
        lines.append(
            f"| {row['run']} | {row['seed']} | {row['family']} ({held}) | {at} | {kind} | {first} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
