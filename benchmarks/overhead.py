"""Step-time overhead of the library's callbacks against bare training, in one process.

Every configuration is a real ``Trainer.fit`` of a fixed number of steps on a fresh copy of the
same model. A timing callback, first in the list, records ``perf_counter`` at each
``on_train_batch_start``: one step is the time between two of them (data, forward, backward,
every callback hook, the optimizer step), and the first ``--warmup`` steps are dropped. Rounds are
interleaved (bare, callback 1, callback 2, ..., then again), each configuration's mean step time
is divided by bare's *in the same round*, and the table gives the median and the min-max of that
ratio over the rounds: slow drifts of a shared machine cancel.

Callbacks are discovered: every ``pl.Callback`` subclass exported by ``lightning_hooks`` gets a
row, so new callbacks appear without editing this file. ``FULL`` holds the options that turn
each one to "every statistic, every step, every leaf module"; unknown options are dropped.

Besides time it reports deterministic measures: host syncs per step between logging points, ATen
operations dispatched per hooked layer per step (``TorchDispatchMode``), per-layer cost at 10, 100
and 1,000 hooked layers, and the error of statistics logged every n steps.

Usage::

    PYTHONPATH=$PWD python benchmarks/overhead.py --quick   # printed only, nothing written
    PYTHONPATH=$PWD python benchmarks/overhead.py --threads 1 --rounds 3 --save  # docs/overhead.md
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import Logger, TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_hooks

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ACCELERATOR = "cpu"
"""The Trainer's accelerator for every fit (``--accelerator``)."""
PRECISION = "32-true"
"""The Trainer's precision for every fit (``--precision``)."""
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ops import OpCounter  # noqa: E402
from tutorial import TutorialHooks  # noqa: E402

from syncs import count_syncs  # noqa: E402

os.environ.setdefault("PL_DISABLE_FORK", "1")
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")
warnings.filterwarnings("ignore", ".*tensorboardX.*")
warnings.filterwarnings("ignore", ".*smaller than the logging interval.*")
for _name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
    logging.getLogger(_name).setLevel(logging.ERROR)

FULL: dict[str, dict[str, Any]] = {
    # "every statistic, every step, every leaf module" per callback; filtered by signature.
    "GradFlowCallback": {"every_n_steps": 1, "update_ratio": True, "output_grad": True},
    "ActivationStatsCallback": {"every_n_steps": 1, "types": None},
    "DeadReLUCallback": {"every_n_steps": 1},
    "SaturationCallback": {"every_n_steps": 1},
    "LayerTimeCallback": {"every_n_steps": 1},
}


def discovered() -> dict[str, type[pl.Callback]]:
    """Every callback class the package exports that builds with no argument, by name.

    ``StatsCallback`` needs its statistics: it is measured through the callbacks built on it.
    """
    found = {}
    for name in getattr(lightning_hooks, "__all__", ()):
        obj = getattr(lightning_hooks, name, None)
        if isinstance(obj, type) and issubclass(obj, pl.Callback) and _needs_no_argument(obj):
            found[name] = obj
    return found


def _needs_no_argument(cls: type) -> bool:
    optional = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return all(
        p.default is not p.empty or p.kind in optional
        for p in inspect.signature(cls).parameters.values()
    )


def _accepted(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in options.items() if k in params}


# --- models ---------------------------------------------------------------------------------


class Bench(pl.LightningModule):
    """A network, a loss, SGD with momentum, and ``n`` fixed batches."""

    def __init__(self, net: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int) -> None:
        super().__init__()
        self.net = net
        self.data = TensorDataset(x, y)
        self.batch = batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch)


def _cnn() -> nn.Module:
    widths = (32, 32, 64, 64, 128, 128, 128, 128)
    layers: list[nn.Module] = []
    cin = 3
    for i, w in enumerate(widths):
        layers += [nn.Conv2d(cin, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(True)]
        if i in (1, 3, 5):
            layers.append(nn.MaxPool2d(2))
        cin = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers)


def _mlp() -> nn.Module:
    width = 1024
    return nn.Sequential(
        nn.Linear(1024, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10),
    )  # fmt: skip


class _Transformer(nn.Module):
    def __init__(self, d: int = 128, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(32, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(dim=1))  # type: ignore[no-any-return]


def _deep(depth: int) -> nn.Module:
    body = [m for _ in range(depth) for m in (nn.Linear(32, 32), nn.ReLU())]
    return nn.Sequential(*body, nn.Linear(32, 10))


def _launch() -> nn.Module:
    """The launch-bound stand-in: 24 x (Linear(64), LayerNorm, ReLU) at batch 16, a
    step of about 3 ms on one CPU thread that is mostly per-op dispatch, as a small model's step
    on a GPU is mostly kernel launches."""
    body = [m for _ in range(24) for m in (nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU())]
    return nn.Sequential(*body, nn.Linear(64, 10))


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    # name: (network, input shape of one sample, batch size)
    "cnn": (_cnn, (3, 32, 32), 64),
    "mlp": (_mlp, (1024,), 64),
    "transformer": (_Transformer, (64, 32), 32),
    "launch": (_launch, (64,), 16),
}


class Resident(Bench):
    """A large model trained on one fixed batch that lives on the model's device, ``steps``
    times: its step is the model's own (no host collation, no host-to-device copy of a 38 MB
    image batch each step)."""

    def __init__(self, net: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
        super().__init__(net, x, y, len(x))
        self.steps = steps

    def train_dataloader(self) -> DataLoader[Any]:
        x, y = (t.to(self.device) for t in self.data.tensors)
        return DataLoader(_Repeat(x, y, self.steps), batch_size=None)


class _Repeat(torch.utils.data.Dataset[Any]):
    """The same ``(x, y)`` batch ``n`` times."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, n: int) -> None:
        self.x, self.y, self.n = x, y, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.y


def _resnet50() -> nn.Module:
    from torchvision.models import resnet50  # on the GPU machine's image; built, not downloaded

    return resnet50(num_classes=10)


class _GPT2(nn.Module):
    """GPT-2 small (124M) from ``transformers``' default config, next-token loss layout."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.lm = GPT2LMHeadModel(GPT2Config())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # logits of tokens 0..T-2 as (batch, vocab, T-1), for cross_entropy against x[:, 1:]
        return self.lm(input_ids=x).logits[:, :-1].transpose(1, 2)  # type: ignore[no-any-return]


LARGE: dict[str, tuple[Callable[[], nn.Module], int]] = {
    # name: (network, batch): ResNet-50 on 224 x 224 images, GPT-2 on 1024 tokens. For
    # --accelerator cuda (with --precision bf16-mixed); not in the default --models.
    "resnet50": (_resnet50, 64),
    "gpt2": (_GPT2, 8),
}


GPT2_TOKENS = 1024  # GPT-2's context


def _large(name: str, steps: int, seed: int) -> Bench:
    build, batch = LARGE[name]
    torch.manual_seed(seed)
    net = build()
    g = torch.Generator().manual_seed(seed)
    if name == "gpt2":
        x = torch.randint(0, 50257, (batch, GPT2_TOKENS), generator=g)
        y = x[:, 1:].clone()
    else:
        x = torch.randn(batch, 3, 224, 224, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
    return Resident(net, x, y, steps)


def make_model(name: str, batches: int, seed: int = 0) -> Bench:
    if name in LARGE:
        return _large(name, batches, seed)
    if name.startswith("deep"):
        build: Callable[[], nn.Module] = lambda: _deep(int(name[4:]))  # noqa: E731
        shape, batch = (32,), 32
    else:
        build, shape, batch = MODELS[name]
    torch.manual_seed(seed)
    net = build()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * batch, *shape, generator=g)
    y = torch.randint(0, 10, (batches * batch,), generator=g)
    return Bench(net, x, y, batch)


# --- configurations -------------------------------------------------------------------------


@dataclass
class Config:
    name: str
    make: Callable[[], list[pl.Callback]]
    options: dict[str, Any] = field(default_factory=dict)


def configs(include_tutorial: bool = True) -> list[Config]:
    found = discovered()
    out = [Config("bare", list)]
    for name, cls in found.items():
        out.append(Config(name, lambda c=cls: [c()]))
    if len(found) > 1:
        out.append(Config("all, defaults", lambda: [c() for c in found.values()]))
    full = {n: _accepted(c, FULL.get(n, {})) for n, c in found.items()}
    out.append(Config("all, every stat/step/leaf", partial(_build, found, full), full))
    fused = {n: {**kw, **_accepted(found[n], {"fused": True})} for n, kw in full.items()}
    if fused != full:  # the compiled one-pass statistics (the first step compiles)
        out.append(Config("all, every stat/step/leaf, fused", partial(_build, found, fused), fused))
    for every in (4, 16):
        every_n = {n: _accepted(c, {"every_n_steps": every}) for n, c in found.items()}
        out.append(Config(f"all, every {every}th step", partial(_build, found, every_n), every_n))
    if "GradFlowCallback" in found:  # the every-step check's share: the same without alarms
        quiet = {"alarms": False}
        out.append(
            Config(
                "GradFlowCallback, alarms off",
                lambda: [found["GradFlowCallback"](**quiet)],
                quiet,
            )
        )
        # the other reads of a quiet step's norms: one _foreach_norm, and (Triton, CUDA only)
        # the opt-in pointer-table kernels
        for way in ("triton",) if ACCELERATOR == "cuda" else ():
            read = {"alarms": lightning_hooks.AlarmRules(quiet_read=way)}
            out.append(
                Config(
                    f"GradFlowCallback, quiet_read={way}",
                    partial(lambda kw: [found["GradFlowCallback"](**kw)], read),
                    read,
                )
            )
        off = {"stability": False}  # the instability statistics' share (attention logits)
        out.append(
            Config(
                "GradFlowCallback, stability off",
                lambda: [found["GradFlowCallback"](**off)],
                off,
            )
        )
    # The floor of a per-step gradient check: one multi-tensor read of the gradients.
    out.append(Config("floor: one gradient read (_foreach_norm)", lambda: [GradientRead()]))
    # The floor of every statistic on every step: each tensor it measures read once, plus the
    # copy and the difference the exact update ratio cannot do without.
    out.append(Config("floor: every stat's data read once (+ update copy)", lambda: [EveryRead()]))
    # The floor: what Lightning's hook dispatch costs for as many callbacks that do nothing.
    out.append(Config(f"{len(found)} empty callbacks", lambda: [pl.Callback() for _ in found]))
    if include_tutorial:
        out.append(Config("tutorial (.item() hooks)", lambda: [TutorialHooks()]))
    return out


class GradientRead(pl.Callback):
    """``torch._foreach_norm`` over the gradients before each optimizer step, nothing else."""

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        torch._foreach_norm(grads)


class EveryRead(pl.Callback):
    """What every statistic on every step cannot do with less, in eager PyTorch: one multi-tensor
    read of the gradients and of the weights, a copy of the weights before the step, after it the
    difference written and read once (the exact update ratio), and one read of every leaf
    module's output and of every output gradient. No statistic is kept."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.params: list[torch.Tensor] = []
        self.before: list[torch.Tensor] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        for name, module in pl_module.named_modules():
            if name and not list(module.children()):
                self.handles.append(module.register_forward_hook(self._read_output))
        for optimizer in trainer.optimizers:
            self.handles.append(optimizer.register_step_post_hook(self._update))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    @staticmethod
    def _read_output(module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and module.training and torch.is_grad_enabled():
            torch.linalg.vector_norm(output.detach())
            if output.requires_grad:
                output.register_hook(EveryRead._read_grad)  # type: ignore[no-untyped-call]

    @staticmethod
    def _read_grad(grad: torch.Tensor) -> None:
        torch.linalg.vector_norm(grad)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        params = [p for p in pl_module.parameters() if p.grad is not None]
        torch._foreach_norm([p.grad for p in params])
        torch._foreach_norm([p.detach() for p in params])
        if len(self.before) != len(params):
            self.before = [torch.empty_like(p) for p in params]
        self.params = params
        torch._foreach_copy_(self.before, [p.detach() for p in params])

    def _update(self, optimizer: Any, *args: Any) -> None:
        torch._foreach_sub_(self.before, [p.detach() for p in self.params])
        torch._foreach_norm(self.before)


def _build(found: dict[str, type[pl.Callback]], kw: dict[str, dict[str, Any]]) -> list[Any]:
    return [cls(**kw[name]) for name, cls in found.items()]


# --- one fit --------------------------------------------------------------------------------


class StepTimer(pl.Callback):
    """Wall and process CPU time between consecutive ``on_train_batch_start``; first in the list.

    On a shared machine the wall clock also counts the time other processes hold the cores;
    the process CPU time (``time.process_time``, all of this process's threads) does not.
    """

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        if ACCELERATOR == "cuda":  # a step ends when its kernels do, not when they are queued
            torch.cuda.synchronize()
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def steps(self, skip: int, clock: str = "wall") -> list[float]:
        marks = self.wall if clock == "wall" else self.cpu
        return [b - a for a, b in zip(marks[skip:], marks[skip + 1 :], strict=False)]


class Window(pl.Callback):
    """Opens a counter (ops or syncs) for steps ``first .. last-1``, closes it before logging."""

    def __init__(self, start: Callable[[], None], stop: Callable[[], None], first: int) -> None:
        self.start, self.stop, self.first = start, stop, first
        self.hooked = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self.first:
            self.hooked = _hooked_layers(pl_module)
            self.start()

    def on_train_epoch_end(self, *args: Any) -> None:
        self.stop()


def _hooked_layers(model: nn.Module) -> int:
    """Modules holding a forward (pre-)hook or owning a parameter with a hook."""
    count = 0
    for module in model.modules():
        own = module.parameters(recurse=False)
        if (
            module._forward_hooks
            or module._forward_pre_hooks
            or any(
                p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None) for p in own
            )
        ):
            count += 1
    return count


class CaptureLogger(Logger):
    """Keeps every logged scalar in memory (for the sampling comparison)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, float] = {}

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.update(metrics)

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


# Models whose ReLU is functional (nn.TransformerEncoderLayer): DeadReLUCallback watches the
# layer that feeds it, as its docstring says to.
PRE_ACTIVATION: dict[str, tuple[str, ...]] = {"transformer": ("*.linear1",)}


def fit(
    model_name: str,
    callbacks: list[pl.Callback],
    steps: int,
    logger: Any = None,
    log_every_n_steps: int = 50,
) -> Bench:
    model = make_model(model_name, steps)
    if model_name in PRE_ACTIVATION:  # the selection is fixed at construction: build it anew
        callbacks = [
            lightning_hooks.DeadReLUCallback(
                pre_activation=PRE_ACTIVATION[model_name], every_n_steps=c.every_n_steps
            )
            if isinstance(c, lightning_hooks.DeadReLUCallback)
            else c
            for c in callbacks
        ]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(
            max_epochs=1,
            limit_train_batches=steps,
            accelerator=ACCELERATOR,
            precision=PRECISION,
            devices=1,
            logger=logger if logger is not None else TensorBoardLogger(tmp, name="tb"),
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            num_sanity_val_steps=0,
            log_every_n_steps=log_every_n_steps,
            callbacks=callbacks,
        )
        trainer.fit(model)
    return model


# --- measurements ---------------------------------------------------------------------------


CLOCKS = ("cpu", "wall", "cpu_median")
"""``cpu_median``: the median step of each fit instead of the mean. Robust to bursts from other
tenants of the host, but blind to a logging step (1 in ``n``): it is the quiet step cost."""


def time_rounds(
    model_name: str, cfgs: list[Config], rounds: int, steps: int, warmup: int
) -> dict[str, Any]:
    """Median step time per configuration and round; ratio to bare in the same round."""
    times: dict[str, dict[str, list[float]]] = {
        clock: {c.name: [] for c in cfgs} for clock in CLOCKS
    }
    fit(model_name, [], warmup + 2)  # process warm-up: allocator, thread pool, imports
    for _ in range(rounds):
        for cfg in cfgs:
            timer = StepTimer()
            fit(model_name, [timer, *cfg.make()], warmup + steps + 1)
            for clock in CLOCKS:
                if clock == "cpu_median":
                    step = statistics.median(timer.steps(warmup, "cpu"))
                else:
                    # The mean, not the median: a logging step every n steps is part of the cost.
                    step = statistics.fmean(timer.steps(warmup, clock))
                times[clock][cfg.name].append(step)
    rows: dict[str, Any] = {}
    for cfg in cfgs:
        rows[cfg.name] = {"options": cfg.options}
        for clock in CLOCKS:
            bare = times[clock]["bare"]
            ratios = [t / b for t, b in zip(times[clock][cfg.name], bare, strict=True)]
            rows[cfg.name][clock] = {
                "step_ms": statistics.median(times[clock][cfg.name]) * 1e3,
                "ratio_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "ratios": ratios,
            }
    return rows


def count_ops(model_name: str, cfg: Config, steps: int = 16, first: int = 1) -> tuple[int, int]:
    """ATen ops per step (steps ``first`` .. ``first + steps - 1``) and hooked layers."""
    counter = OpCounter()
    window = Window(counter.start, counter.stop, first)
    fit(model_name, [window, *cfg.make()], first + steps)
    return counter.total // steps, window.hooked


@contextmanager
def _sync_counter(root: str) -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as mp, count_syncs(mp, root=root) as counter:
        yield counter


def count_syncs_per_step(model_name: str, cfg: Config, steps: int = 4) -> float:
    """Host syncs per step made from the library (or the tutorial hooks) between logging points."""
    tutorial = cfg.name.startswith("tutorial")
    root = str(Path(__file__).parent / "tutorial.py") if tutorial else lightning_hooks.__path__[0]
    with _sync_counter(root) as counter:

        def start() -> None:
            counter.active = True

        def stop() -> None:
            counter.active = False

        fit(model_name, [Window(start, stop, 0), *cfg.make()], steps)
    return sum(counter.calls.values()) / steps


def depth_scaling(depths: list[int], rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    """Per-hooked-layer cost of the callbacks at defaults, on deep MLPs of 32-wide layers."""
    found = discovered()
    cfgs = [Config("bare", list), Config("all", lambda: [c() for c in found.values()])]
    out = {}
    for depth in depths:
        rows = time_rounds(f"deep{depth}", cfgs, rounds, steps, warmup)
        ops, hooked = count_ops(f"deep{depth}", cfgs[1], steps=2)
        bare_ops, _ = count_ops(f"deep{depth}", cfgs[0], steps=2)
        bare, cb = rows["bare"]["cpu"], rows["all"]["cpu"]
        bare_ms, ratio = bare["step_ms"], cb["ratio_median"]
        out[str(depth)] = {
            "hooked_layers": hooked,
            "bare_step_ms": bare_ms,
            "ratio_median": ratio,
            "ratio_min": cb["ratio_min"],
            "ratio_max": cb["ratio_max"],
            "us_per_layer": (ratio - 1) * bare_ms * 1e3 / max(hooked, 1),
            "ops_per_layer": (ops - bare_ops) / max(hooked, 1),
        }
    return out


def sampling_error(model_name: str, every: list[int], steps: int) -> dict[str, Any]:
    """Relative error of the epoch means logged with ``every_n_steps=n`` against n = 1, per
    statistic (median and max over its layers and the global row)."""
    found = discovered()
    logged: dict[int, dict[str, float]] = {}
    for n in [1, *every]:
        logger = CaptureLogger()
        kw = {name: _accepted(c, {"every_n_steps": n, "chart": False}) for name, c in found.items()}
        fit(model_name, _build(found, kw), steps, logger)
        logged[n] = logger.metrics
    out = {}
    for n in every:
        by_stat: dict[str, list[float]] = {}
        for tag, v in logged[n].items():
            ref = logged[1].get(tag)
            if _is_logging_step_mean(tag) and ref not in (None, 0.0):
                by_stat.setdefault(_stat(tag), []).append(abs(v - ref) / abs(ref))
        errs = [e for values in by_stat.values() for e in values]
        out[str(n)] = {
            "means_compared": len(errs),
            "rel_error_median": statistics.median(errs) if errs else None,
            "rel_error_max": max(errs) if errs else None,
            "by_stat": {k: [statistics.median(v), max(v)] for k, v in sorted(by_stat.items())},
        }
    return out


def _stat(tag: str) -> str:
    """``family/stat`` of ``family/stat/layer`` or ``family/global/stat``."""
    parts = tag.split("/")
    return f"{parts[0]}/{parts[2] if parts[1] == 'global' else parts[1]}"


def _is_logging_step_mean(tag: str) -> bool:
    """An epoch mean over logging steps: not a max, min, count, timing or probe value. The mean
    activation itself is left out: it sits near 0 for a Linear output, so its relative error
    says nothing (``abs_mean`` and ``std`` stand for it)."""
    if tag.count("/") < 2 or tag.startswith(("layer_time/", "feature_map/")):
        return False
    stat = _stat(tag).split("/")[1]
    if stat in ("min", "max", "mean", "nonfinite", "dead_count", "dead_fraction", "layers"):
        return False
    return not stat.endswith(("_max", "nonfinite", "_p05", "_p50", "_p95"))


# --- report ---------------------------------------------------------------------------------


def _table(results: dict[str, Any], clock: str) -> str:
    models = list(results["timing"])
    names = list(results["timing"][models[0]])
    head = "| configuration | " + " | ".join(models) + " |"
    lines = [head, "|---" * (len(models) + 1) + "|"]
    for name in names:
        cells = []
        for m in models:
            r = results["timing"][m][name][clock]
            if name == "bare":
                cells.append(f"{r['step_ms']:.1f} ms/step")
            else:
                cells.append(
                    f"{r['ratio_median']:.3f}x ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})"
                )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _measures_table(results: dict[str, Any]) -> str:
    lines = [
        "| model | configuration | hooked layers | extra ATen ops/step | per hooked layer "
        "| host syncs/step |",
        "|---|---|---|---|---|---|",
    ]
    for model, rows in results["measures"].items():
        for name, r in rows.items():
            lines.append(
                f"| {model} | {name} | {r['hooked_layers']} | {r['extra_ops']} "
                f"| {r['ops_per_layer']:.2f} | {r['syncs_per_step']:g} |"
            )
    return "\n".join(lines)


def _depth_table(results: dict[str, Any]) -> str:
    lines = [
        "| hooked layers | bare CPU ms/step | all callbacks | us per hooked layer "
        "| ATen ops/layer |",
        "|---|---|---|---|---|",
    ]
    for r in results["depth"].values():
        lines.append(
            f"| {r['hooked_layers']} | {r['bare_step_ms']:.2f} | {r['ratio_median']:.3f}x "
            f"({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) | {r['us_per_layer']:.1f} "
            f"| {r['ops_per_layer']:.2f} |"
        )
    return "\n".join(lines)


def _sampling_table(results: dict[str, Any]) -> str:
    every = list(results["sampling"])
    stats = sorted({k for r in results["sampling"].values() for k in r["by_stat"]})
    lines = [
        "| statistic (median / max over layers) | " + " | ".join(f"every {n}" for n in every) + " |"
    ]
    lines.append("|---" * (len(every) + 1) + "|")
    for stat in stats:
        cells = []
        for n in every:
            got = results["sampling"][n]["by_stat"].get(stat)
            cells.append(f"{got[0]:.2%} / {got[1]:.2%}" if got else "")
        lines.append(f"| {stat} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    env = results["env"]
    parts = [
        f"Mean step time vs bare (median ratio over {env['rounds']} interleaved rounds, min-max), "
        f"{env['steps']} timed steps after {env['warmup']} warm-up steps, "
        f"torch {env['torch']}, {env['threads']} threads, {env['device']}, "
        f"precision {env.get('precision', '32-true')}, load average "
        f"{env['load_before'][0]:.1f} before, {env['load_after'][0]:.1f} after.",
        "",
        "Process CPU time per step (what the step costs this process):",
        "",
        _table(results, "cpu"),
        "",
        "Wall time per step (includes waiting for cores held by other processes):",
        "",
        _table(results, "wall"),
        "",
        "Median CPU step of each fit (robust to other tenants; a logging step every n is not in "
        "it: this is the quiet-step cost):",
        "",
        _table(results, "cpu_median"),
    ]
    if results.get("measures"):
        parts += ["", "Deterministic measures (mean over steps 1-16):", ""]
        parts.append(_measures_table(results))
    if results.get("depth"):
        parts += ["", "Cost against depth (deep MLP of 32-wide Linear + ReLU):", ""]
        parts.append(_depth_table(results))
    if results.get("sampling"):
        parts += ["", f"Sampling: epoch means vs every step ({results['sampling_model']}):", ""]
        parts.append(_sampling_table(results))
    return "\n".join(parts) + "\n"


def measures(models: list[str], cfgs: list[Config]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model in models:
        bare_ops, _ = count_ops(model, cfgs[0])
        out[model] = {}
        for cfg in cfgs[1:]:
            ops, hooked = count_ops(model, cfg)
            out[model][cfg.name] = {
                "hooked_layers": hooked,
                "extra_ops": ops - bare_ops,
                "ops_per_layer": (ops - bare_ops) / max(hooked, 1),
                "syncs_per_step": count_syncs_per_step(model, cfg),
            }
    return out


def _matches(pattern: str, name: str) -> bool:
    """``--only`` patterns: a substring of the configuration's name, or ``=name`` exactly."""
    return name == pattern[1:] if pattern.startswith("=") else pattern in name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--quick`` fills in its smaller settings."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=[*MODELS, *LARGE])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--steps",
        type=int,
        default=50,
        help="timed steps per fit (50, the default cadence: each fit holds one logging step "
        "at the defaults, the same share as a long run)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--depths", type=int, nargs="*", default=[10, 100, 1000])
    parser.add_argument("--sample-every", type=int, nargs="*", default=[2, 4, 8, 16, 50])
    parser.add_argument("--sample-model", default="mlp", choices=list(MODELS))
    parser.add_argument("--sample-steps", type=int, default=200)
    parser.add_argument(
        "--accelerator",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where every fit trains (cuda: the step timer synchronizes at each step start)",
    )
    parser.add_argument(
        "--precision", default="32-true", help="the Trainer's precision (e.g. bf16-mixed)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--only",
        nargs="*",
        default=[],
        help="time only the configurations whose name contains one of these, or is =NAME "
        "(bare always)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3 rounds, the MLP only (unless --models), depths 10 100",
    )
    parser.add_argument(
        "--save",
        action="store_true",
        help="write the results to --out (.md and .json); without it they are only printed",
    )
    parser.add_argument(
        "--out",
        default=str(RESULTS / "overhead"),
        help="where --save writes, without suffix (default: the tracked benchmarks/results/)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.depths, args.sample_every = 3, 50, [10, 100], [4]
        if args.models == list(MODELS):
            args.models = ["mlp"]
    return args


def save(results: dict[str, Any], out: Path) -> None:
    """Write ``out.json`` (every round, the command, the load) and ``out.md`` (the tables)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2, default=repr) + "\n")
    out.with_suffix(".md").write_text(markdown(results))


def _device_name(accelerator: str) -> str:
    if accelerator == "cuda":
        return f"CUDA ({torch.cuda.get_device_name()})"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def main(argv: list[str] | None = None) -> None:
    global ACCELERATOR, PRECISION  # settings read by every fit of this run
    args = parse_args(argv)
    ACCELERATOR, PRECISION = args.accelerator, args.precision
    if args.threads:
        torch.set_num_threads(args.threads)
    pl.seed_everything(0, verbose=False)
    cfgs = configs()
    if args.only:
        cfgs = [c for c in cfgs if c.name == "bare" or any(_matches(o, c.name) for o in args.only)]
    env = {
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "threads": torch.get_num_threads(),
        "precision": args.precision,
        "device": _device_name(args.accelerator),
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "callbacks": list(discovered()),
        "command": "python benchmarks/overhead.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "load_before": os.getloadavg(),
    }
    started = time.perf_counter()
    results: dict[str, Any] = {"env": env, "timing": {}}
    for model in args.models:
        results["timing"][model] = time_rounds(model, cfgs, args.rounds, args.steps, args.warmup)
        print(f"timed {model} ({time.perf_counter() - started:.0f}s)", file=sys.stderr)
    results["measures"] = measures(args.models, cfgs)
    if args.depths:
        rounds = max(2, args.rounds // 2)
        results["depth"] = depth_scaling(args.depths, rounds, args.steps, args.warmup)
    if args.sample_every:
        results["sampling_model"] = f"{args.sample_model}, {args.sample_steps} steps"
        results["sampling"] = sampling_error(
            args.sample_model, args.sample_every, args.sample_steps
        )
    env["load_after"] = os.getloadavg()
    env["wall_s"] = time.perf_counter() - started
    print(markdown(results))
    if args.save:
        save(results, Path(args.out))
        print(f"saved {args.out}.md and .json", file=sys.stderr)
    else:
        print(f"not saved: add --save to write {args.out}.md and .json", file=sys.stderr)


if __name__ == "__main__":
    main()
