"""Peak memory of measuring one long-sequence attention call: the capture making the whole
``[B, H, L, S]`` logits at once against a chunk of query rows at a time (``LOGIT_BUDGET``).

One ``scaled_dot_product_attention`` layer (batch 1, 8 heads of 64, causal) under
``StabilityStats`` on a training forward of a logging step, on the CPU; each budget runs in its own
process, which reports its peak resident memory (``ru_maxrss``) over a bare forward and
backward of the same layer in the same process.

Usage::

    PYTHONPATH=$PWD python benchmarks/attention_memory.py   # about 30 s on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional

ROOT = Path(__file__).resolve().parents[1]
HEADS, WIDTH = 8, 64


class Attention(nn.Module):
    """One causal self-attention over ``HEADS`` heads of ``WIDTH``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HEADS * WIDTH, 3 * HEADS * WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, WIDTH).permute(2, 0, 3, 1, 4)
        return functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def one(length: int, budget: int | None) -> dict[str, float]:
    """In this process: the bare step's peak, then the measured step's, in MiB."""
    from lightning_hooks.core.stats import attention
    from lightning_hooks.core.stats.stability import StabilityStats

    torch.manual_seed(0)
    net = Attention()
    x = torch.randn(1, length, HEADS * WIDTH)
    net(x).sum().backward()
    bare = _peak_mib()
    if budget is not None:
        attention.LOGIT_BUDGET = budget
    with StabilityStats().attach(net) as stat:
        net(x).sum().backward()
        stat.end_step()
        entropy = stat.tags(stat.result())["stability/attn_entropy_min/"]
    return {"bare_mib": bare, "measured_mib": _peak_mib(), "entropy": entropy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "attention_memory"))
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(one(args.length, args.child or None)))
        return
    from lightning_hooks.core.stats.attention import LOGIT_BUDGET

    full = args.length * args.length * HEADS  # the whole logits' elements
    rows = {}
    for name, budget in (("whole logits at once", full), (f"chunks of {LOGIT_BUDGET}", 0)):
        cmd = [sys.executable, __file__, "--length", str(args.length), "--child", str(budget)]
        got = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows[name] = json.loads(got.stdout.strip().splitlines()[-1])
    lines = [
        f"One causal sdpa layer, batch 1, {HEADS} heads of {WIDTH}, {args.length} tokens (the "
        f"logits: {full * 4 / 2**20:.0f} MiB in float32), CPU. Peak resident memory, MiB.",
        "",
        "| capture | bare forward + backward | with StabilityStats | added | entropy |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in rows.items():
        added = r["measured_mib"] - r["bare_mib"]
        lines.append(
            f"| {name} | {r['bare_mib']:.0f} | {r['measured_mib']:.0f} | {added:.0f} | "
            f"{r['entropy']:.6f} |"
        )
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"length": args.length, "rows": rows}) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
