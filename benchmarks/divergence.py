"""The early warning judged on real divergence: learning-rate sweeps on real data, every rule set
replayed on the same recorded traces, this library's and its peers'.

Data that ships with installed packages, nothing downloaded: scikit-learn's ``load_digits``
(8x8 images, 10 classes) for an MLP and a CNN with BatchNorm; the source text of Python's own
``argparse`` module for a character-level LSTM and tiny pre-LN and post-LN transformers. Each run
is 300 optimizer steps, SGD or Adam, from a healthy learning rate to a divergent one (a constant
LR, or a linear ramp that rises past what the model can take), several seeds.

Each step records what the sentinel reads (per-layer gradient L2 norms and the global one, before
the optimizer step) and the training loss, into one trace file (``--traces``); the rules are then
replayed on the traces: ours through the real :class:`~lightning_hooks.core.GradientAlarms`, the
peers' re-implemented from their published sources at their defaults (see :data:`PEERS`).

Ground truth, from the loss alone (:func:`divergence_step`): a run diverges at the first step
where the loss is not finite, or where the mean loss of the last 5 steps is at least twice its
best so far *and* has given back at least half of what it had learnt (best vs the first step's
loss). A run that never does is healthy.

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_hooks.callbacks.alarm_policy import check_actions
from lightning_hooks.core import AlarmRules, GradientAlarms, ParamLayout
from lightning_hooks.core.grad_stats import param_norms, segment_norm

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STEPS = 300
SMOOTH = 5  # steps in the ground truth's mean loss
SEEDS = (0, 1, 2)
HELD_OUT = (2,)  # seeds not looked at while the defaults were chosen
_SEQ, _VOCAB = 32, 96
WARNED = tuple(rule for rule, action in check_actions("warn").items() if action == "warn")
"""The rules that warn under the default ``on_alarm="warn"``."""

# --- data -------------------------------------------------------------------------------------


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
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
    "cnn": _cnn,
    "lstm": _LSTM,
    "pre-ln": lambda: _Transformer(pre_ln=True),
    "post-ln": lambda: _Transformer(pre_ln=False),
}
CHANCE = {"mlp": math.log(10), "cnn": math.log(10)}  # the text models: log(vocabulary in use)


# --- the sweep --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One training run: model, optimizer, learning rate and its schedule, seed."""

    model: str
    optimizer: str
    lr: float
    schedule: str = "constant"  # or "ramp": linear from 0 to ``lr`` over the run
    seed: int = 0

    @property
    def name(self) -> str:
        ramp = ", ramp" if self.schedule == "ramp" else ""
        return f"{self.model}, {self.optimizer} {self.lr:g}{ramp}"


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


def _optimizer(run: Run, model: nn.Module) -> torch.optim.Optimizer:
    if run.optimizer == "sgd":
        momentum = 0.0 if run.model == "lstm" else 0.9
        return torch.optim.SGD(model.parameters(), lr=run.lr, momentum=momentum)
    return torch.optim.Adam(model.parameters(), lr=run.lr)


def _batches(run: Run, gen: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    if run.model in ("mlp", "cnn"):
        x, y = _digits()
        while True:
            idx = torch.randint(0, len(x), (32,), generator=gen)
            yield x[idx], y[idx]
    text = _text()
    while True:
        start = torch.randint(0, len(text) - _SEQ - 1, (16,), generator=gen)
        window = torch.stack([text[s : s + _SEQ + 1] for s in start.tolist()])
        yield window[:, :-1], window[:, 1:]


def _layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if any(True for _ in m.parameters(False))]


def train(
    run: Run, built: Callable[[nn.Module], object] | None = None
) -> Iterator[tuple[nn.Module, ParamLayout, torch.Tensor, torch.Tensor]]:
    """Train ``run`` for ``STEPS`` steps from its seed: yields the model, its layout, the output
    and the loss after each backward, before the optimizer step, which runs when the caller asks
    for the next step (and after the last one, when the loop ends). ``built`` sees the model
    before its first forward (to hook it)."""
    torch.manual_seed(run.seed)
    gen = torch.Generator().manual_seed(run.seed)
    model = BUILD[run.model]()
    if built is not None:
        built(model)
    opt = _optimizer(run, model)
    layout = ParamLayout.from_modules(_layers(model))
    batches = _batches(run, gen)
    for step in range(STEPS):
        if run.schedule == "ramp":
            for group in opt.param_groups:
                group["lr"] = run.lr * (step + 1) / STEPS
        x, y = next(batches)
        opt.zero_grad()
        out = model(x)
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        yield model, layout, out, loss
        opt.step()


def grad_norms(layout: ParamLayout) -> np.ndarray:
    """Per-layer gradient L2 norms, then the global one (a parameter without a gradient: 0)."""
    grads = [p.grad if p.grad is not None else p.new_zeros(1) for p in layout.params]
    with torch.no_grad():
        return segment_norm(param_norms(grads), layout.index, len(layout.layers)).numpy().copy()


def record(run: Run) -> dict[str, Any]:
    """Train ``run`` and record what the sentinel reads each step: per-layer gradient norms (then
    the global one) and the loss; also the weight norms, for rules that want them."""
    norms, weights, losses = [], [], []
    layers: list[str] = []
    for _, layout, _, loss in train(run):
        layers = layout.layers
        norms.append(grad_norms(layout))
        with torch.no_grad():
            n = len(layout.layers)
            weights.append(segment_norm(param_norms(layout.params), layout.index, n).numpy().copy())
        losses.append(float(loss.detach()))
    return {
        "run": asdict(run),
        "layers": [*layers, "global"],
        "norms": np.array(norms, dtype=np.float64),
        "weights": np.array(weights, dtype=np.float64),
        "losses": np.array(losses, dtype=np.float64),
    }


def record_all(
    path: Path, record: Callable[[Run], dict[str, Any]] = record
) -> list[dict[str, Any]]:
    """Every run of the sweep on every seed, recorded by ``record`` and saved to ``path``."""
    started = time.perf_counter()
    traces = []
    for seed in SEEDS:
        for run in SWEEP:
            traces.append(record(Run(**{**asdict(run), "seed": seed})))
            t = traces[-1]
            print(
                f"{time.perf_counter() - started:5.0f}s {run.name} seed {seed}: loss "
                f"{t['losses'][0]:.3g} -> {np.nanmin(t['losses']):.3g} -> {t['losses'][-1]:.3g}, "
                f"diverges at {divergence_step(t['losses'])}",
                file=sys.stderr,
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(traces, path)
    return traces


# --- ground truth -----------------------------------------------------------------------------


def divergence_step(losses: np.ndarray) -> int | None:
    """First step where the loss is not finite, or where the mean of the last ``SMOOTH`` losses
    is >= 2x its best so far and has given back >= half of what it had learnt (best vs the first
    step's loss); ``None``: healthy."""
    first, best = losses[0], math.inf
    for step, loss in enumerate(losses):
        if not math.isfinite(loss):
            return step
        mean = float(np.mean(losses[max(0, step - SMOOTH + 1) : step + 1]))
        best = min(best, mean)
        if mean >= 2.0 * best and mean - best >= 0.5 * max(first - best, 0.0):
            return step
    return None


# --- the rule sets: ours (the real GradientAlarms) and the peers' (from their sources) --------


def ours(
    rules: AlarmRules, warn: tuple[str, ...] = WARNED
) -> Callable[[dict[str, Any]], list[int]]:
    """This library's sentinel at ``rules``: the steps of its alarms of the ``warn`` rules (by
    default, those that warn under ``GradFlowCallback``'s default ``on_alarm="warn"``)."""

    def replay(trace: dict[str, Any]) -> list[int]:
        alarms = GradientAlarms(trace["layers"], rules)
        found = []
        for step, (norm, loss) in enumerate(zip(trace["norms"], trace["losses"], strict=True)):
            alarms.update(torch.from_numpy(norm).float(), step=step)
            alarms.update_loss(torch.tensor(loss, dtype=torch.float32), step=step)
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


def score(
    traces: list[dict[str, Any]], replay: Callable[[dict[str, Any]], list[int]]
) -> dict[str, Any]:
    """Per run: the divergence step and the first warning; totals for divergent and healthy."""
    rows = []
    for trace in traces:
        found = sorted(replay(trace))
        rows.append(
            {
                "run": Run(**trace["run"]).name,
                "seed": trace["run"]["seed"],
                "diverges_at": divergence_step(trace["losses"]),
                "first_warning": found[0] if found else None,
                "warnings": len(found),
            }
        )
    return {"runs": rows, **_totals(rows)}


def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    divergent = [r for r in rows if r["diverges_at"] is not None]
    healthy = [r for r in rows if r["diverges_at"] is None]
    leads = [
        r["diverges_at"] - r["first_warning"]
        for r in divergent
        if r["first_warning"] is not None and r["first_warning"] <= r["diverges_at"]
    ]
    return {
        "divergent": len(divergent),
        "warned_in_time": len(leads),
        "median_lead": float(np.median(leads)) if leads else None,
        "healthy": len(healthy),
        "healthy_warned": sum(r["first_warning"] is not None for r in healthy),
    }


def shape(losses: np.ndarray, step: int) -> str:
    """The failure's shape: ``early`` (diverged within the first 10 steps), ``drift`` (its mean
    loss still at or below the first step's loss: a slow return towards chance), else
    ``blow-up`` (after a healthy start, the loss above where it started, or not finite)."""
    if step < 10:
        return "early"
    mean = float(np.mean(losses[max(0, step - SMOOTH + 1) : step + 1]))
    return "drift" if math.isfinite(mean) and mean <= losses[0] else "blow-up"


RULE_SETS: dict[str, Callable[[dict[str, Any]], list[int]]] = {
    "lightning_hooks, defaults": ours(AlarmRules()),
    "lightning_hooks before issue 21 (spike warns, no loss rule)": ours(
        AlarmRules(diverge_ratio=None), ("spike", "absolute", "vanishing", "nonfinite")
    ),
    **PEERS,
}


def _subset(result: dict[str, Any], keep: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    return _totals([r for r in result["runs"] if keep(r)])


def parse_args(
    script: str,
    traces: str,
    argv: list[str] | None,
    doc: str | None,
    record: Callable[[Path], list[dict[str, Any]]] = record_all,
) -> tuple[argparse.Namespace, list[dict[str, Any]], float, float]:
    """The options every script on these runs takes, and the traces: recorded with ``record``
    when asked or when the file ``traces`` (under ``benchmarks/results``) is missing, else
    loaded. Returns the options, the traces, when the script started and how long that took.
    """
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    parser.add_argument("--record", action="store_true", help="record the traces again")
    parser.add_argument("--traces", default=str(RESULTS / f"{traces}.pt"))
    parser.add_argument("--out", default=str(RESULTS / script))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    path = Path(args.traces)
    loaded = (
        record(path) if args.record or not path.exists() else torch.load(path, weights_only=False)
    )
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
        "record_s": recorded,
        "wall_s": time.perf_counter() - started,
        "defaults": asdict(AlarmRules()),
    }


def main(argv: list[str] | None = None) -> None:
    args, traces, started, recorded = parse_args("divergence", "divergence_traces", argv, __doc__)
    shapes = {
        (Run(**t["run"]).name, t["run"]["seed"]): shape(t["losses"], step)
        for t in traces
        if (step := divergence_step(t["losses"])) is not None
    }
    results: dict[str, Any] = {}
    for name, replay in RULE_SETS.items():
        result = score(traces, replay)
        result["tuning_seeds"] = _subset(result, lambda r: r["seed"] not in HELD_OUT)
        result["held_out_seeds"] = _subset(result, lambda r: r["seed"] in HELD_OUT)
        result["by_shape"] = {
            kind: _subset(result, lambda r, k=kind: shapes.get((r["run"], r["seed"])) == k)
            for kind in ("early", "blow-up", "drift")
        }
        results[name] = result
        print(f"{time.perf_counter() - started:5.0f}s replayed {name}", file=sys.stderr)
    out = {
        **result_header("divergence", argv, started, recorded),
        "shapes": {f"{run}, seed {seed}": kind for (run, seed), kind in shapes.items()},
        "rule_sets": results,
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


def markdown(out: dict[str, Any]) -> str:
    sets = out["rule_sets"]
    seeds = ", ".join(str(s) for s in out["seeds"])
    held = ", ".join(str(s) for s in out["held_out_seeds"])
    lines = [
        f"{len(next(iter(sets.values()))['runs'])} runs ({len(SWEEP)} settings x seeds {seeds}), "
        f"{out['steps']} steps each; every rule set replayed on the same traces. Divergent "
        "runs warned at or before the step the loss diverged; median lead in steps (over those "
        "warned in time); healthy runs with any warning.",
        "",
        "| rule set | divergent runs warned in time | median lead (steps) | healthy runs warned |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {name} | {_cells(r)} |" for name, r in sets.items()]
    lines += [
        "",
        f"Seeds used to choose the defaults vs held out (seed {held}):",
        "",
        "| rule set | tuning: warned in time | lead | healthy warned | held out: warned in time "
        "| lead | healthy warned |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {name} | {_cells(r['tuning_seeds'])} | {_cells(r['held_out_seeds'])} |"
        for name, r in sets.items()
    ]
    lines += [
        "",
        "By the shape of the failure (divergent runs: warned in time, median lead):",
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
    lines += ["", "Per run (ground truth; first warning of the defaults):", ""]
    lines += [
        "| run | seed | diverges at | shape | first warning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in sets["lightning_hooks, defaults"]["runs"]:
        kind = out["shapes"].get(f"{row['run']}, seed {row['seed']}", "healthy")
        at = "-" if row["diverges_at"] is None else row["diverges_at"]
        first = "-" if row["first_warning"] is None else row["first_warning"]
        lines.append(f"| {row['run']} | {row['seed']} | {at} | {kind} | {first} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
