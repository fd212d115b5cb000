"""What the attention statistics add to a logging step, and that a quiet step pays nothing.

The transformer of ``overhead.py`` (d=128, 4 layers, 4 heads, batch 32) at several sequence
lengths, twice: as it is (``nn.TransformerEncoderLayer``: ``nn.MultiheadAttention``, measured by
recomputing q.k from its inputs) and with its attention computed by
``scaled_dot_product_attention`` in a nanoGPT-style module (measured through the
``TorchFunctionMode``). One training step (forward, backward) is timed with no statistic, with
:class:`~lightning_hooks.core.stats.stability.StabilityStats` attached on a quiet step, and on a
logging step, alternating in every round; the median of ``--rounds`` rounds after ``--warmup``,
on ``--threads`` CPU threads.

    python benchmarks/attention_cost.py --lengths 64 128 256 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional

from lightning_hooks.core.stats.stability import StabilityStats

D, DEPTH, HEADS, BATCH = 128, 4, 4, 32


class _SdpaLayer(nn.Module):
    """A pre-LN block whose attention is one ``scaled_dot_product_attention`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.ReLU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        y = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, D))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mha":
        layer = nn.TransformerEncoderLayer(D, HEADS, 4 * D, dropout=0.0, batch_first=True)
        body: nn.Module = nn.TransformerEncoder(layer, DEPTH, enable_nested_tensor=False)
    else:
        body = nn.Sequential(*[_SdpaLayer() for _ in range(DEPTH)])
    return nn.Sequential(nn.Linear(32, D), body, nn.Linear(D, 10))


def _time(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def measure(kind: str, length: int, rounds: int, warmup: int) -> dict[str, float]:
    """Median step milliseconds: bare model; a copy with the statistic attached on a quiet step
    and on a logging step. The three alternate in every round, so that a busy machine's drift
    falls on all three alike."""
    bare, hooked = _model(kind), _model(kind)
    x = torch.randn(BATCH, length, 32)
    stat = StabilityStats().attach(hooked)
    assert stat.registry is not None
    registry = stat.registry

    def run(model: nn.Module, logging_step: bool) -> Callable[[], None]:
        def step() -> None:
            registry.logging_step = logging_step
            model(x).square().mean().backward()
            stat.end_step()  # as GradFlowCallback does: settles the output layer

        return step

    steps = {
        "bare": run(bare, False),
        "quiet": run(hooked, False),
        "logging_step": run(hooked, True),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(warmup + rounds):
        for name, step in steps.items():
            took = _time(step)
            if i >= warmup:
                times[name].append(took)
    stat.remove()
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _table(rows: list[dict[str, object]]) -> str:
    lines = [
        "| attention | length | bare ms | quiet ms | logging step ms | logging step added |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        bare, quiet, logging_step = (float(r[k]) for k in ("bare", "quiet", "logging_step"))  # type: ignore[arg-type]
        lines.append(
            f"| {r['kind']} | {r['length']} | {bare:.1f} | {quiet:.1f} | {logging_step:.1f} | "
            f"{logging_step - bare:+.1f} ms ({logging_step / bare:.2f}x) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows: list[dict[str, object]] = []
    for kind in ("sdpa", "mha"):
        for length in args.lengths:
            got = measure(kind, length, args.rounds, args.warmup)
            rows.append({"kind": kind, "length": length, **got})
            print(rows[-1], flush=True)
    table = _table(rows)
    print(table)
    if args.out is not None:
        header = f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {BATCH}\n\n"
        (args.out / "attention_cost.md").write_text(header + table + "\n")
        (args.out / "attention_cost.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
