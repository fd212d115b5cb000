"""False alarms on healthy runs and detection steps on injected faults, for the gradient alarms.

Every run is a small model trained in a plain loop on the CPU (seconds each). Each step's
per-layer gradient L2 norms (before the optimizer step, the every-step check's input) and the loss
are recorded, then replayed through :class:`~lightning_hooks.core.TrainingAlarms` under each
candidate rule setting: the rules are exactly the library's, and one trace serves every setting.
Faults that need the weights (a NaN written into a weight) run live through a
:class:`~lightning_hooks.core.GradFlowTracker` at the defaults.

Healthy runs: Adam, SGD with momentum and a linear warm-up, random labels, batches of 2, a small
CNN, a small transformer with warm-up; several seeds each, 400 steps. Faults: a one-step gradient
spike of 10x to 1e6x on one layer, a learning rate raised 30x (a real divergence), the gradients
of two of three layers zeroed (dead layers), one layer's gradient shrunk 1e-6x, a NaN written
into a weight, a corrupted batch (inputs x 30, for the loss rule).

Usage::

    PYTHONPATH=$PWD python benchmarks/alarms.py            # the table (about 2 minutes here)
    PYTHONPATH=$PWD python benchmarks/alarms.py --seeds 1  # quicker
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_hooks.core import (
    AlarmFeed,
    AlarmRules,
    GradFlowTracker,
    ParamLayout,
    TrainingAlarms,
)
from lightning_hooks.core.ops.grad_stats import param_norms, segment_norm

ROOT = Path(__file__).resolve().parents[1]
STEPS = 400

# --- models and data --------------------------------------------------------------------------


class _MLP(nn.Module):
    """16 -> 64 -> 64 -> 4 with ReLUs; layers ``net.0``, ``net.2``, ``net.4``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


def _mlp() -> nn.Module:
    return _MLP()


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
    )  # fmt: skip


class _Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(dim=1))  # type: ignore[no-any-return]


SHAPES = {"mlp": (16,), "cnn": (3, 8, 8), "transformer": (8, 16)}
BUILD: dict[str, Callable[[], nn.Module]] = {"mlp": _mlp, "cnn": _cnn, "transformer": _Transformer}


@dataclass
class Run:
    """One training run: model, optimizer, schedule, data, and an optional fault."""

    name: str
    model: str = "mlp"
    optimizer: str = "adam"
    lr: float = 1e-3
    batch: int = 32
    warmup: int = 0
    random_labels: bool = False
    fault: str = ""
    fault_step: int = 137
    fault_size: float = 1e6
    seed: int = 0
    steps: int = STEPS
    extra: dict[str, Any] = field(default_factory=dict)


def _batches(run: Run, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = SHAPES[run.model]
    n = 2048
    x = torch.randn(n, *shape, generator=gen)
    teacher = torch.randn(int(np.prod(shape)), 4, generator=gen)
    y = (x.flatten(1) @ teacher).argmax(dim=1)
    if run.random_labels:
        y = torch.randint(0, 4, (n,), generator=gen)
    return x, y


def _optimizer(run: Run, model: nn.Module) -> torch.optim.Optimizer:
    if run.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=run.lr, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=run.lr)


def _layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if any(True for _ in m.parameters(False))]


@dataclass
class Trace:
    """Per-step gradient norms ``[steps, layers + 1]`` and losses of one run."""

    layers: tuple[str, ...]
    norms: np.ndarray
    losses: np.ndarray


def _lr_at(run: Run, step: int) -> float:
    lr = run.lr * min(1.0, (step + 1) / run.warmup) if run.warmup else run.lr
    if run.fault == "lr" and step >= run.fault_step:
        lr *= run.fault_size
    return lr


def _inject(run: Run, step: int, layout: ParamLayout, x: torch.Tensor) -> torch.Tensor:
    """Faults in the gradient (after backward) and in the batch (before forward)."""
    if run.fault == "batch" and step == run.fault_step:
        return x * run.fault_size
    return x


def _inject_grads(run: Run, step: int, model: nn.Module) -> None:
    layers = dict(_layers(model))
    names = list(layers)
    if run.fault == "spike" and step == run.fault_step:
        for p in layers[names[1]].parameters(False):
            assert p.grad is not None
            p.grad.mul_(run.fault_size)
    if run.fault == "dead" and step >= run.fault_step:
        for name in names[:2]:
            for p in layers[name].parameters(False):
                assert p.grad is not None
                p.grad.zero_()
    if run.fault == "shrink" and step >= run.fault_step:
        for p in layers[names[0]].parameters(False):
            assert p.grad is not None
            p.grad.mul_(1e-6)


def record(run: Run) -> Trace:
    """Train ``run`` and record what the every-step check reads each step."""
    torch.manual_seed(run.seed)
    gen = torch.Generator().manual_seed(run.seed)
    model = BUILD[run.model]()
    opt = _optimizer(run, model)
    layout = ParamLayout.from_modules(_layers(model))
    x_all, y_all = _batches(run, gen)
    norms, losses = [], []
    for step in range(run.steps):
        idx = torch.randint(0, len(x_all), (run.batch,), generator=gen)
        x = _inject(run, step, layout, x_all[idx])
        for group in opt.param_groups:
            group["lr"] = _lr_at(run, step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y_all[idx])
        loss.backward()
        _inject_grads(run, step, model)
        grads = [p.grad if p.grad is not None else p.new_zeros(1) for p in layout.params]
        with torch.no_grad():
            norm = segment_norm(param_norms(grads), layout.index, len(layout.layers))
        norms.append(norm.numpy().copy())
        losses.append(float(loss.detach()))
        opt.step()
    return Trace((*layout.layers, "global"), np.array(norms), np.array(losses))


def replay(trace: Trace, rules: AlarmRules) -> list[tuple[int, str, str]]:
    """``(step, rule, layer)`` of every alarm the rules raise on ``trace``."""
    alarms = TrainingAlarms(trace.layers, rules)
    found = []
    for step, (norm, loss) in enumerate(zip(trace.norms, trace.losses, strict=True)):
        alarms.update(torch.from_numpy(norm), step=step)
        alarms.update_loss(torch.tensor(loss), step=step)
        found += [(a.step, a.rule, a.layer) for a in alarms.poll()]
    return found


def nan_weight_live(seed: int, step: int = 20) -> list[tuple[int, str, str]]:
    """A NaN written into the second layer's weight at ``step``, through the tracker."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    run = Run("nan", seed=seed)
    x_all, y_all = _batches(run, gen)
    found: list[tuple[int, str, str]] = []
    with GradFlowTracker(model, [opt]) as tracker:
        feed = AlarmFeed(tracker, AlarmRules())
        for s in range(step + 3):
            tracker.registry.logging_step = False  # the every-step check alone, as on a quiet step
            if s == step:
                with torch.no_grad():
                    model.net[2].weight[0, 0] = math.nan
            idx = torch.randint(0, len(x_all), (32,), generator=gen)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
            feed.observe(opt, tracker.observe(opt), step=s)
            found += [(a.step, a.rule, a.layer) for a in feed.training_alarms.poll()]
            opt.step()
    return found


# --- the table --------------------------------------------------------------------------------

HEALTHY = [
    Run("MLP, Adam 1e-3, batch 32"),
    Run("MLP, SGD 0.05 + warm-up 100", optimizer="sgd", lr=0.05, warmup=100),
    Run("MLP, Adam, random labels", random_labels=True),
    Run("MLP, SGD 0.02, batch 2", optimizer="sgd", lr=0.02, batch=2),
    Run("MLP, Adam 1e-2, batch 4", lr=1e-2, batch=4),
    Run("CNN + BN, Adam 1e-3, batch 16", model="cnn", batch=16),
    Run("CNN + BN, SGD 0.05 + warm-up 50, random labels", model="cnn", optimizer="sgd",
        lr=0.05, warmup=50, random_labels=True, batch=8),
    Run("transformer, Adam 3e-4 + warm-up 50, batch 8", model="transformer", lr=3e-4,
        warmup=50, batch=8),
]  # fmt: skip

FAULTS = [
    Run("spike 1e6x, one layer, step 37", fault="spike", fault_step=37),
    Run("spike 1e6x, one layer, step 137", fault="spike"),
    Run("spike 100x, one layer, step 137", fault="spike", fault_size=100.0),
    Run("spike 10x, one layer, step 137", fault="spike", fault_size=10.0),
    Run("spike 1e6x, one layer, step 3", fault="spike", fault_step=3),
    Run("SGD 0.05, lr x30 from step 137", optimizer="sgd", lr=0.05, fault="lr", fault_size=30.0),
    Run("2 of 3 layers' gradients zero from step 137", fault="dead"),
    Run("first layer's gradient x1e-6 from step 137", fault="shrink"),
    Run("batch inputs x30 at step 137", fault="batch", fault_size=30.0),
]

CANDIDATES = {
    "defaults": {},
    "min_history=5": {"min_history": 5},
    "spike_factor=5": {"spike_factor": 5.0},
    "spike_factor=20": {"spike_factor": 20.0},
    "spike_sigmas=3": {"spike_sigmas": 3.0},
    "spike_sigmas=6": {"spike_sigmas": 6.0},
    "window=20": {"window": 20},
    "window=100": {"window": 100},
    "loss_factor=2": {"loss_factor": 2.0},
    "loss_factor=3": {"loss_factor": 3.0},
    "vanish_steps=10": {"vanish_steps": 10},
}


def _first(found: list[tuple[int, str, str]], after: int) -> str:
    hits = [f for f in found if f[0] >= after]
    if not hits:
        return "none"
    step = min(s for s, _, _ in hits)
    rules = sorted({f"{r} {layer}" for s, r, layer in hits if s == step})
    return f"{step} ({', '.join(rules)})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "alarms"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    configs = {name: AlarmRules(**kw) for name, kw in CANDIDATES.items()}
    false_alarms: dict[str, dict[str, int]] = {}
    worst: dict[str, list[float]] = {}
    for run in HEALTHY:
        false_alarms[run.name] = dict.fromkeys(configs, 0)
        worst[run.name] = []
        for seed in range(args.seeds):
            trace = record(Run(**{**run.__dict__, "seed": seed}))
            worst[run.name].append(_worst_ratio(trace))
            for name, rules in configs.items():
                false_alarms[run.name][name] += len(replay(trace, rules))
        print(f"healthy: {run.name} ({time.perf_counter() - started:.0f}s)", file=sys.stderr)
    detection: dict[str, dict[str, str]] = {}
    for run in FAULTS:
        trace = record(run)
        detection[run.name] = {
            n: _first(replay(trace, r), run.fault_step) for n, r in configs.items()
        }
    detection["NaN in a weight of the 2nd layer at step 20 (live, tracker)"] = dict.fromkeys(
        configs, _first(nan_weight_live(0), 0)
    )
    results = {
        "seeds": args.seeds,
        "steps": STEPS,
        "torch": torch.__version__,
        "wall_s": time.perf_counter() - started,
        "candidates": CANDIDATES,
        "false_alarms": false_alarms,
        "worst_ratio_to_scale": worst,
        "detection": detection,
        "command": "python benchmarks/alarms.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


def _worst_ratio(trace: Trace) -> float:
    """Largest ``norm / running scale`` of a healthy trace, after the rules arm (defaults)."""
    rules = AlarmRules()
    alarms = TrainingAlarms(trace.layers, rules)
    worst = 0.0
    for step, norm in enumerate(trace.norms):
        scale = np.exp(alarms._gradients.scale.state[0])
        armed = alarms._gradients.scale.state[2] >= rules.min_history
        alarms.update(torch.from_numpy(norm), step=step)
        alarms.poll()
        ratio = np.where(armed & (norm > 0), norm / scale, 0.0)
        worst = max(worst, float(ratio.max()))
    return worst


def markdown(results: dict[str, Any]) -> str:
    names = list(results["candidates"])
    lines = [
        f"False alarms on healthy runs ({results['seeds']} seeds x {results['steps']} steps "
        "each; every rule, every step):",
        "",
        "| healthy run | worst norm / scale | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for run, counts in results["false_alarms"].items():
        worst = max(results["worst_ratio_to_scale"][run])
        lines.append(
            f"| {run} | {worst:.2f}x | " + " | ".join(str(counts[n]) for n in names) + " |"
        )
    lines += [
        "",
        "Detection: first alarm at or after the fault's step (rule, layer):",
        "",
        "| fault | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for fault, cells in results["detection"].items():
        lines.append(f"| {fault} | " + " | ".join(cells[n] for n in names) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
