"""Growth signals for lead time: do the weights, the updates, the layers' outputs or
the attention logits grow before a real divergence, early enough to warn 5 steps ahead?

The runs, data, seeds and ground truth are ``benchmarks/divergence.py``'s (its 22 settings x 3
seeds, 300 steps): each run is trained again with the same seed, so its loss and gradient norms
are the same, and each step also records (see :func:`record`)

- ``update``: per layer (then all) the update-to-weight ratio ``||w_t - w_{t-1}|| / ||w_{t-1}||``
  of the optimizer step;
- ``weight``: per layer (then all) the weight L2 norm before the step;
- ``rms``: the output RMS of every ``nn.Linear`` layer (an attention block's: its ``out_proj``
  output), Rybakov et al. 2024 (arXiv 2410.16682);
- ``attn``: the largest attention logit ``q.k / sqrt(d)`` (over the unmasked entries, heads and
  batch) per attention layer, recomputed from the block's input and ``in_proj`` weights;
- ``lse``: the output logits' log-partition ``logsumexp`` (its mean and its largest magnitude
  over the tokens of the batch), what z-loss keeps near zero.

Each signal is then fed, as ``log`` values per channel (layer), to a small family of causal,
scale-free rules (:data:`FAMILIES`: the smoothed value over its running minimum, growth over
``k`` steps, a short EMA over a long one, a z-score on the log-value), each armed from step 3 or
10, and scored as ``divergence.py`` scores a rule set: divergent runs warned at or before their
divergence step, the median lead, healthy runs warned; alone and OR'd with the library's defaults.
A warning more than ``HORIZON`` (50) steps ahead is counted apart, as premature: on these runs it
comes in the first steps of a run that diverges a hundred or more steps later, a false alarm, not a
lead (:data:`BUDGETS` says how each column of best rules treats it; ``plain`` counts it as a lead,
as ``divergence.py`` would). Rules are chosen on seeds 0-1 and checked on the held-out seed 2.
:func:`separation` compares, without any rule, each signal's growth just before the late
divergences with the largest growth of the healthy runs.

Usage::

    PYTHONPATH=$PWD python benchmarks/growth_signals.py            # record (if needed), score
    PYTHONPATH=$PWD python benchmarks/growth_signals.py --record   # record the traces again
"""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from divergence import (
    HELD_OUT,
    SWEEP,
    Run,
    divergence_step,
    grad_norms,
    ours,
    parse_args,
    record_all,
    result_header,
    shape,
    train,
)
from scipy.signal import lfilter
from torch import nn

from lightning_hooks.core import AlarmRules, ParamLayout
from lightning_hooks.core.ops.grad_stats import param_norms, segment_norm

LEAD = 5  # the target lead, in steps
HORIZON = 50  # a warning further ahead than this is premature: the run was still healthy
LATE = ("blow-up", "drift")  # the shapes a warning can lead; early blow-ups (< 10 steps) cannot
BIG = 700.0  # a non-finite value's log: larger than any growth, so every rule fires on it

# --- recording ---------------------------------------------------------------------------------


class _Probe:
    """Forward hooks that keep, for the current step, the output RMS of every ``nn.Linear`` layer
    (an attention block's under ``{block}.out_proj``: torch calls its weights, not the module) and
    the largest attention logit of every ``nn.MultiheadAttention`` (batch-first, as here)."""

    def __init__(self, model: nn.Module) -> None:
        self.rms: dict[str, torch.Tensor] = {}
        self.attn: dict[str, torch.Tensor] = {}
        for name, module in model.named_modules():
            if isinstance(module, nn.MultiheadAttention):
                module.register_forward_pre_hook(partial(self._logits, name), with_kwargs=True)
                module.register_forward_hook(partial(self._rms, f"{name}.out_proj"))
            elif isinstance(module, nn.Linear) and not name.endswith("out_proj"):
                module.register_forward_hook(partial(self._rms, name))

    def _rms(self, name: str, _module: nn.Module, _args: Any, output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        self.rms[name] = out.detach().float().square().mean().sqrt()

    @torch.no_grad()
    def _logits(
        self, name: str, module: nn.MultiheadAttention, args: Any, kwargs: dict[str, Any]
    ) -> None:
        query, key = args[0], args[1]
        e, heads = module.embed_dim, module.num_heads
        weight, bias = module.in_proj_weight, module.in_proj_bias
        q = nn.functional.linear(query, weight[:e], bias[:e])
        k = nn.functional.linear(key, weight[e : 2 * e], bias[e : 2 * e])
        b, s, _ = q.shape
        q = q.view(b, s, heads, e // heads).transpose(1, 2)
        k = k.view(b, k.shape[1], heads, e // heads).transpose(1, 2)
        logits = q @ k.transpose(-1, -2) / math.sqrt(e // heads)
        mask = kwargs.get("attn_mask")
        if mask is None and kwargs.get("is_causal"):
            mask = nn.Transformer.generate_square_subsequent_mask(s)
        if mask is not None:
            logits = (
                logits + mask if mask.is_floating_point() else logits.masked_fill(mask, -math.inf)
            )
        self.attn[name] = logits.amax()


def record(run: Run) -> dict[str, Any]:
    """``divergence.record`` (the same seed, batches and steps, so the same losses and gradient
    norms), plus the growth signals of the module docstring."""
    keep: dict[str, list[np.ndarray]] = {k: [] for k in ("norms", "weights", "update", "lse")}
    rms, attn, losses = [], [], []
    probes: list[_Probe] = []
    before: list[torch.Tensor] = []
    weight = torch.zeros(0)

    def update(layout: ParamLayout) -> None:
        """The last step's update over the weights before it, per layer (then all weights)."""
        with torch.no_grad():
            delta = torch._foreach_sub([p.detach() for p in layout.params], before)
            moved = segment_norm(param_norms(delta), layout.index, len(layout.layers))
            keep["update"].append((moved / weight).numpy().copy())

    layout: ParamLayout | None = None
    for _, layout, out, loss in train(run, lambda model: probes.append(_Probe(model))):
        if before:
            update(layout)  # the optimizer step of the step before has run
        keep["norms"].append(grad_norms(layout))
        with torch.no_grad():
            n = len(layout.layers)
            weight = segment_norm(param_norms(layout.params), layout.index, n)
            keep["weights"].append(weight.numpy().copy())
            lse = out.detach().float().logsumexp(-1)
            keep["lse"].append(np.array([float(lse.mean().abs()), float(lse.abs().amax())]))
            before = [p.detach().clone() for p in layout.params]
        rms.append({k: float(v) for k, v in probes[0].rms.items()})
        attn.append({k: float(v) for k, v in probes[0].attn.items()})
        losses.append(float(loss.detach()))
    assert layout is not None
    update(layout)  # the last step's
    return {
        "run": asdict(run),
        "layers": [*layout.layers, "global"],
        **{k: np.array(v, dtype=np.float64) for k, v in keep.items()},
        "losses": np.array(losses, dtype=np.float64),
        "rms_layers": list(rms[0]),
        "rms": np.array([[r[k] for k in rms[0]] for r in rms], dtype=np.float64),
        "attn_layers": list(attn[0]),
        "attn": np.array([[a[k] for k in attn[0]] for a in attn], dtype=np.float64),
    }


# --- the signals and the rules -----------------------------------------------------------------

SIGNALS: dict[str, Callable[[dict[str, Any]], np.ndarray]] = {
    "update/weight ratio, per layer": lambda t: t["update"][:, :-1],
    "update/weight ratio, all weights": lambda t: t["update"][:, -1:],
    "weight norm, per layer": lambda t: t["weights"][:, :-1],
    "weight norm, all weights": lambda t: t["weights"][:, -1:],
    "Linear output RMS, per layer": lambda t: t["rms"],
    "largest attention logit, per layer": lambda t: t["attn"],
    "output logsumexp, mean over tokens (magnitude)": lambda t: t["lse"][:, :1],
    "output logsumexp, largest over tokens (magnitude)": lambda t: t["lse"][:, 1:],
}
"""Per signal: the ``[steps, channels]`` values a rule reads (channels: layers; none where a model
has no such layer, e.g. attention outside the transformers: the rule never fires there)."""

COST = {
    "update/weight ratio, per layer": "a copy of the weights before the step, 1 foreach norm",
    "update/weight ratio, all weights": "a copy of the weights before the step, 1 foreach norm",
    "weight norm, per layer": "1 foreach norm of the weights",
    "weight norm, all weights": "1 foreach norm of the weights",
    "Linear output RMS, per layer": "a forward hook and 1 reduction per Linear layer",
    "largest attention logit, per layer": "QK^T again per attention layer (sampled steps)",
    "output logsumexp, mean over tokens (magnitude)": "1 logsumexp over the output logits",
    "output logsumexp, largest over tokens (magnitude)": "1 logsumexp over the output logits",
}


def _log(values: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log(np.maximum(values, 1e-30))
    return np.nan_to_num(logs, nan=BIG, posinf=BIG, neginf=-BIG)


def _ema(y: np.ndarray, span: int) -> np.ndarray:
    """EMA over about ``span`` steps along the steps, started at the first value."""
    if span <= 1:
        return y
    alpha = 2.0 / (span + 1)
    out, _ = lfilter([alpha], [1.0, alpha - 1.0], y, axis=0, zi=(1 - alpha) * y[:1])
    return np.asarray(out)


def over_min(y: np.ndarray, span: int, factor: float) -> np.ndarray:
    """The ``span``-step EMA of the log-value is ``factor`` x above its lowest so far."""
    s = _ema(y, span)
    return np.asarray(s - np.minimum.accumulate(s, axis=0) > math.log(factor))


def growth(y: np.ndarray, k: int, factor: float) -> np.ndarray:
    """The value grew ``factor``-fold over the last ``k`` steps."""
    k = int(k)
    fires = np.zeros(y.shape, dtype=bool)
    fires[k:] = y[k:] - y[:-k] > math.log(factor)
    return fires


def ema_ratio(y: np.ndarray, short: int, long: int, factor: float) -> np.ndarray:
    """The ``short``-step EMA of the log-value is ``factor`` x above the ``long``-step one."""
    return np.asarray(_ema(y, short) - _ema(y, long) > math.log(factor))


def zscore(y: np.ndarray, window: int, z: float, repeat: int) -> np.ndarray:
    """The log-value is ``z`` spreads above its EMA mean (over about ``window`` steps, before
    this step) for ``repeat`` steps in a row; the spread is at least 1 % (log 1.01)."""
    mean, square = _ema(y, window), _ema(y * y, window)
    std = np.sqrt(np.maximum(square - mean * mean, 0.0))
    high = np.zeros(y.shape, dtype=bool)
    high[1:] = y[1:] - mean[:-1] > z * np.maximum(std[:-1], math.log(1.01))
    run = high.copy()
    for back in range(1, int(repeat)):
        run[back:] &= high[:-back]
        run[:back] = False
    return run


@dataclass(frozen=True)
class Rule:
    """One rule of a family at one setting, armed from step ``arm``."""

    family: str
    params: tuple[float, ...]
    arm: int

    @property
    def name(self) -> str:
        args = ", ".join(f"{p:g}" for p in self.params)
        return f"{self.family}({args}), from step {self.arm}"

    def first(self, values: np.ndarray) -> int | None:
        """The first step (from ``arm``) where any channel fires; ``None``: never."""
        if values.shape[1] == 0:
            return None
        fires = FAMILIES[self.family][0](_log(values), *self.params)[self.arm :].any(axis=1)
        return int(np.argmax(fires)) + self.arm if fires.any() else None


FAMILIES: dict[str, tuple[Callable[..., np.ndarray], list[tuple[float, ...]]]] = {
    "over_min": (over_min, list(itertools.product((1, 3, 5), (1.5, 2, 3, 5, 10)))),
    "growth": (growth, list(itertools.product((3, 5, 10, 20), (1.5, 2, 3, 5, 10)))),
    "ema_ratio": (ema_ratio, list(itertools.product((1, 4), (20, 100), (1.5, 2, 3, 5)))),
    "zscore": (zscore, list(itertools.product((20, 50), (3, 5, 8), (1, 3)))),
}
"""Each family's function (the log-values ``[steps, channels]`` and the parameters in, the
steps x channels where it fires out) and the settings tried."""

RULES = [
    Rule(family, tuple(float(p) for p in params), arm)
    for family, (_, settings) in FAMILIES.items()
    for params in settings
    for arm in (3, 10)
]


# --- scoring -----------------------------------------------------------------------------------


def _counts(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Divergent runs warned in time, with a lead of ``LEAD`` to ``HORIZON`` steps, and more than
    ``HORIZON`` steps ahead (premature); the median lead (over all warned in time, as
    ``divergence.py``); healthy runs warned; false alarms: healthy runs warned and premature
    warnings; by the first warning in ``row[key]``."""
    divergent = [r for r in rows if r["diverges_at"] is not None]
    leads = [
        r["diverges_at"] - r[key]
        for r in divergent
        if r[key] is not None and r[key] <= r["diverges_at"]
    ]
    healthy = [r for r in rows if r["diverges_at"] is None]
    return {
        "divergent": len(divergent),
        "warned_in_time": len(leads),
        "lead_5": sum(LEAD <= lead <= HORIZON for lead in leads),
        "premature": sum(lead > HORIZON for lead in leads),
        "median_lead": float(np.median(leads)) if leads else None,
        "healthy": len(healthy),
        "healthy_warned": sum(r[key] is not None for r in healthy),
        "false_alarms": sum(r[key] is not None for r in healthy)
        + sum(lead > HORIZON for lead in leads),
    }


def _subsets(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """``_counts`` on tuning and held-out seeds, all, and by shape (all seeds)."""
    tuning = [r for r in rows if r["seed"] not in HELD_OUT]
    held = [r for r in rows if r["seed"] in HELD_OUT]
    out = {
        "all": _counts(rows, key),
        "tuning": _counts(tuning, key),
        "held_out": _counts(held, key),
        "late_tuning": _counts([r for r in tuning if r["shape"] in (*LATE, "healthy")], key),
        "late_held_out": _counts([r for r in held if r["shape"] in (*LATE, "healthy")], key),
    }
    for kind in ("early", *LATE):
        out[kind] = _counts([r for r in rows if r["shape"] == kind], key)
    return out


def _merge(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def score(
    rule: Rule, signal: str, traces: list[dict[str, Any]], base: list[dict[str, Any]]
) -> dict[str, Any]:
    """The rule's first warning per run (``first``, in the order of ``base``), counted alone and
    OR'd with the defaults."""
    rows = []
    for trace, row in zip(traces, base, strict=True):
        first = rule.first(SIGNALS[signal](trace))
        rows.append({**row, "first": first, "either": _merge(first, row["defaults"])})
    return {
        "rule": rule.name,
        "first": [r["first"] for r in rows],
        "alone": _subsets(rows, "first"),
        "with_defaults": _subsets(rows, "either"),
    }


def _base(traces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run: name, seed, ground truth, shape, and the first warning of the defaults."""
    defaults = ours(AlarmRules())
    rows = []
    for trace in traces:
        at = divergence_step(trace["losses"])
        found = sorted(defaults(trace))
        rows.append(
            {
                "run": Run(**trace["run"]).name,
                "seed": trace["run"]["seed"],
                "diverges_at": at,
                "shape": "healthy" if at is None else shape(trace["losses"], at),
                "defaults": found[0] if found else None,
            }
        )
    return rows


BUDGETS: dict[str, tuple[int | None, bool]] = {
    "strict": (0, True),
    "lenient": (2, True),
    "any": (None, True),
    "plain": (0, False),
}
"""Per choice: the false alarms on the tuning seeds that a rule may add, OR'd with the defaults,
to the defaults' own (``None``: no bound), and whether a warning more than ``HORIZON`` steps ahead
is premature (a false alarm, not a lead). ``strict``: none (the bar is at most 1 in 20, 2
of 45 held-out seed included, and the defaults already warn 2); ``lenient``: 2; ``any``: the most
lead there is; ``plain``: ``divergence.py``'s definition, any warning at or before the divergence
step is in time and its lead counts however long, and only healthy runs warned are false
alarms."""


def pick(scores: list[dict[str, Any]], base: dict[str, Any], choice: str) -> dict[str, Any]:
    """The rule that, OR'd with the defaults, warns the most late divergences of the tuning seeds
    ``LEAD`` to ``HORIZON`` steps ahead (``plain``: ``LEAD`` or more), within the ``choice``'s
    budget of false alarms beyond the defaults' (``base``: their counts on the tuning seeds);
    ties: more warned in time but not prematurely, fewer false alarms, a longer median lead."""
    budget, horizon = BUDGETS[choice]
    alarms = "false_alarms" if horizon else "healthy_warned"

    def key(s: dict[str, Any]) -> tuple[float, ...]:
        late, tuning = s["with_defaults"]["late_tuning"], s["with_defaults"]["tuning"]
        lead = late["median_lead"] if late["median_lead"] is not None else -1.0
        timely = late["warned_in_time"] - late["premature"] * horizon
        ahead = late["lead_5"] + late["premature"] * (not horizon)
        return (ahead, timely, -tuning[alarms], lead)

    fits = [
        s
        for s in scores
        if budget is None or s["with_defaults"]["tuning"][alarms] <= base[alarms] + budget
    ]
    return max(fits, key=key)


def _compact(s: dict[str, Any]) -> dict[str, Any]:
    """One grid line, tuning and held out, OR'd with the defaults: late divergences warned with
    a lead of ``LEAD`` to ``HORIZON``, in time, prematurely; median lead; healthy runs warned
    (by the rule alone, then with the defaults)."""
    out: dict[str, Any] = {"rule": s["rule"]}
    for part in ("late_tuning", "late_held_out"):
        alone, both = s["alone"][part], s["with_defaults"][part]
        out[part] = [
            both["lead_5"],
            both["warned_in_time"],
            both["premature"],
            both["median_lead"],
            alone["healthy_warned"],
            both["healthy_warned"],
        ]
    return out


WINDOW = 10  # steps of growth in the separation table


def separation(traces: list[dict[str, Any]]) -> dict[str, Any]:
    """Per signal, rule-free: the growth (largest over the channels) over the ``WINDOW`` steps that
    end ``LEAD`` steps before the divergence, on the late divergent runs where that window starts
    at step 10 or later; and the largest such growth a healthy run shows anywhere from step 10 on.
    A growth rule that leads by ``LEAD`` steps needs the first above the second."""
    out = {}
    for signal, values in SIGNALS.items():
        late, healthy = [], []
        for trace in traces:
            y = _log(values(trace))
            if y.shape[1] == 0:
                continue
            grown = np.exp((y[WINDOW:] - y[:-WINDOW]).max(axis=1))  # index i: window ending i + W
            at = divergence_step(trace["losses"])
            if at is None:
                healthy.append(float(grown[10:].max()))
            elif at - LEAD - WINDOW >= 10:
                late.append(float(grown[at - LEAD - WINDOW]))
        out[signal] = {"late": late, "healthy": healthy}
    return out


def _dumps(out: dict[str, Any]) -> str:
    """JSON, indented, with each list of numbers on one line."""
    text = json.dumps(out, indent=1)
    flat = re.sub(r"\[\s+([-\d.eE,\snul]+?)\s+\]", lambda m: f"[{' '.join(m[1].split())}]", text)
    return flat + "\n"


def main(argv: list[str] | None = None) -> None:
    args, traces, started, recorded = parse_args(
        "growth_signals", "growth_traces", argv, __doc__, partial(record_all, record=record)
    )
    base = _base(traces)
    own = _counts([r for r in base if r["seed"] not in HELD_OUT], "defaults")
    signals: dict[str, Any] = {}
    for signal in SIGNALS:
        scores = [score(rule, signal, traces, base) for rule in RULES]
        signals[signal] = {
            "cost": COST[signal],
            "best": {choice: pick(scores, own, choice) for choice in BUDGETS},
            "grid": [_compact(s) for s in scores],
        }
        print(f"{time.perf_counter() - started:5.0f}s scored {signal}", file=sys.stderr)
    out = {
        **result_header("growth_signals", argv, started, recorded),
        "lead": LEAD,
        "horizon": HORIZON,
        "budgets": BUDGETS,
        "base": {"runs": base, "scores": _subsets(base, "defaults")},
        "signals": signals,
        "separation": separation(traces),
    }
    target = Path(args.out)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.with_suffix(".json").write_text(_dumps(out))
    target.with_suffix(".md").write_text(markdown(out))
    print(markdown(out))


def _lead(t: dict[str, Any]) -> str:
    return "-" if t["median_lead"] is None else f"{t['median_lead']:g}"


def _late(t: dict[str, Any]) -> str:
    """Late divergences: lead 5-50 / warned in time (premature), of all; median lead."""
    return (
        f"{t['lead_5']} / {t['warned_in_time']} ({t['premature']}) of {t['divergent']} | {_lead(t)}"
    )


def _row(name: str, rule: str, s: dict[str, Any]) -> str:
    cells = []
    for part in ("late_tuning", "late_held_out"):
        alone, both = s["alone"][part], s["with_defaults"][part]
        cells.append(
            f"{_late(both)} | {alone['healthy_warned']} / {both['healthy_warned']} of "
            f"{both['healthy']}"
        )
    return f"| {name} | {rule} | " + " | ".join(cells) + " |"


def _shapes(s: dict[str, Any]) -> str:
    cells = []
    for kind in ("early", *LATE):
        t = s[kind]
        cells.append(
            f"{t['warned_in_time']} ({t['premature']}) of {t['divergent']}, {t['lead_5']}, "
            f"{_lead(t)}"
        )
    t = s["all"]
    cells.append(
        f"{t['warned_in_time']} ({t['premature']}) of {t['divergent']}, {t['lead_5']}, {_lead(t)}"
    )
    cells.append(f"{t['healthy_warned']} of {t['healthy']}")
    return " | ".join(cells)


def markdown(out: dict[str, Any]) -> str:
    base = {"rule": "-", "alone": out["base"]["scores"], "with_defaults": out["base"]["scores"]}
    lines = [
        f"Growth signals on `benchmarks/divergence.py`'s runs ({len(SWEEP)} settings x seeds "
        f"{', '.join(map(str, out['seeds']))}, {out['steps']} steps), written by "
        f"`{out['command'].strip()}`. {len(RULES)} rules per signal (4 families, armed from step "
        "3 or 10), chosen on seeds 0-1, checked on the held-out seed "
        f"{', '.join(map(str, out['held_out_seeds']))}.",
        "",
        "Late divergences (a blow-up after a healthy start, a slow drift) of the rule OR'd with "
        f"the defaults: warned {LEAD} to {HORIZON} steps ahead / warned in time (of which "
        f"premature: more than {HORIZON} steps ahead), of all; median lead in steps over all "
        "warned in time (as in `divergence.md`); healthy runs warned by the rule alone / OR'd "
        "with the defaults. False alarms: healthy runs warned plus premature warnings.",
    ]
    for budget, what in (
        ("strict", "no false alarm beyond the defaults' (tuning seeds)"),
        ("lenient", "at most 2 false alarms beyond the defaults' (tuning seeds)"),
        ("any", "no bound on false alarms: the most lead there is"),
        (
            "plain",
            "no healthy run warned beyond the defaults' (tuning seeds), every warning in time "
            "counted as a lead however early (`divergence.py`'s definition: add the premature "
            "count to the first column)",
        ),
    ):
        lines += [
            "",
            f"Best rule per signal, {what}:",
            "",
            f"| signal | rule | tuning: late lead {LEAD}-{HORIZON} / in time (premature) | lead "
            f"| healthy warned | held out: late lead {LEAD}-{HORIZON} / in time (premature) "
            "| lead | healthy warned |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
            _row("defaults alone", "-", base),
        ]
        lines += [
            _row(signal, s["best"][budget]["rule"], s["best"][budget])
            for signal, s in out["signals"].items()
        ]
    lines += [
        "",
        "The strict and the plain best, OR'd with the defaults, all seeds, by shape (warned in "
        f"time (premature) of all, warned {LEAD} to {HORIZON} steps ahead, median lead), all "
        "divergent runs, healthy runs warned:",
        "",
        "| signal | choice | early blow-up | blow-up after a healthy start | slow drift "
        "| all divergent | healthy warned |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| defaults alone | - | {_shapes(out['base']['scores'])} |",
    ]
    lines += [
        f"| {signal} | {choice} | {_shapes(s['best'][choice]['with_defaults'])} |"
        for signal, s in out["signals"].items()
        for choice in ("strict", "plain")
    ]
    lines += [
        "",
        f"Without any rule: the growth over the {WINDOW} steps that end {LEAD} steps before the "
        f"divergence (largest over the layers), on the late divergent runs where those steps "
        f"start at step 10 or later, against the largest growth over any {WINDOW} steps from "
        "step 10 on of each healthy run (median, 90th percentile, largest over the runs). A rule "
        f"that leads by {LEAD} without warning healthy runs needs the first above the last:",
        "",
        "| signal | late runs | their growth, median (range) | healthy runs | their largest "
        "growth: median, 90th pct, largest |",
        "| --- | --- | --- | --- | --- |",
    ]
    for signal, sep in out["separation"].items():
        late, healthy = np.array(sep["late"]), np.array(sep["healthy"])
        lines.append(
            f"| {signal} | {len(late)} | {np.median(late):.2f}x ({late.min():.2f}x to "
            f"{late.max():.2f}x) | {len(healthy)} | {np.median(healthy):.2f}x, "
            f"{np.percentile(healthy, 90):.2f}x, {healthy.max():.3g}x |"
        )
    lines += ["", "What each signal costs per step:", "", "| signal | cost |", "| --- | --- |"]
    lines += [f"| {signal} | {s['cost']} |" for signal, s in out["signals"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
