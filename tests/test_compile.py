"""``torch.compile``: a compiled LightningModule or inner network with GradFlowCallback.

The suite compiles with ``backend="aot_eager"``: Dynamo traces the hooks and AOTAutograd builds
the joint forward/backward graph, which is where hooks can break, graph-break or recompile;
Inductor's code generation changes kernels, not hooks, and costs about 20 s per fit on 2 CPU
cores, so its run is opt-in (``LH_HEAVY=1``).

Measured (torch 2.13, TinyMLP, 2 epochs): the compiled module makes 2 graphs, with or without
the callback (the second is Dynamo specializing ``batch_idx``, the model's own int argument), and
the compiled inner network 1; no graph break, and no new graph after the first epoch.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from lightning_hooks import GradFlowCallback
from lightning_hooks.core import ALARM_RULES

from conftest import TinyMLP, hooks_left, make_trainer, read_scalars


class GraphCounter(pl.Callback):
    """Dynamo's count of compiled graphs at each epoch end."""

    def __init__(self) -> None:
        self.graphs: list[int] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.graphs.append(counters["stats"]["unique_graphs"])


def _compiled(mode: str, backend: str) -> tuple[TinyMLP, Any]:
    torch.manual_seed(0)
    model = TinyMLP()
    if mode == "inner":
        model.net = torch.compile(model.net, backend=backend)  # type: ignore[assignment]
        return model, model
    return model, torch.compile(model, backend=backend)


def _compiled_fit(root: Path, mode: str, backend: str, callbacks: list[Any]) -> GraphCounter:
    torch._dynamo.reset()
    counters.clear()
    graphs = GraphCounter()
    model, compiled = _compiled(mode, backend)
    make_trainer(root, max_epochs=2, callbacks=[*callbacks, graphs]).fit(compiled)
    assert hooks_left(model) == []
    assert not counters["graph_break"], dict(counters["graph_break"])
    return graphs


def _check_against_eager(mode: str, backend: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    make_trainer(tmp_path / "eager", max_epochs=2, callbacks=[GradFlowCallback()]).fit(TinyMLP())
    bare = _compiled_fit(tmp_path / "bare", mode, backend, [])
    hooked = _compiled_fit(tmp_path / "compiled", mode, backend, [GradFlowCallback()])
    assert hooked.graphs == bare.graphs  # the hooks add no graph and no recompilation
    assert hooked.graphs[0] == hooked.graphs[1]  # nothing compiled after the first epoch
    eager = read_scalars(tmp_path / "eager")
    compiled = read_scalars(tmp_path / "compiled")
    # Modules in a compiled region get no instability statistics (core/stats/stability.py says
    # why); TinyMLP, a regressor with one output, has no log-partition in eager either.
    assert not [t for t in eager if t.startswith("stability/")]
    assert not [t for t in compiled if t.startswith("stability/")]
    tags = {t for t in eager if t.startswith("grad_flow/")}
    epoch = {t for t in tags if "_step" not in t}
    # per epoch: 3 layers x 10 per-layer tags, 8 global tags, one alarm count per rule, the spike
    # score; per
    # logging step: 7 of them per layer, 6 global (no *_max: one step), the alarm counts
    assert len(epoch) == 3 * 10 + 8 + len(ALARM_RULES) + 1
    assert len(tags - epoch) == 3 * 7 + 6 + len(ALARM_RULES)
    assert {t for t in compiled if t.startswith("grad_flow/")} == tags
    for tag in tags:
        for (step, got), (at, want) in zip(compiled[tag], eager[tag], strict=True):
            assert step == at and math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-9), tag


@pytest.mark.parametrize("mode", ["module", "inner"])
def test_compiled_training_matches_eager(mode: str, tmp_path: Path) -> None:
    _check_against_eager(mode, "aot_eager", tmp_path)


@pytest.mark.skipif(os.environ.get("LH_HEAVY") != "1", reason="Inductor: ~20 s per fit; LH_HEAVY=1")
@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")  # Inductor's
def test_compiled_with_inductor_matches_eager(tmp_path: Path) -> None:
    _check_against_eager("module", "inductor", tmp_path)


class _Block(torch.nn.Module):
    """A residual block around ``scaled_dot_product_attention``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 4, 4).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).flatten(2))


class _TwoBlocks(pl.LightningModule):
    """Embedding, two attention blocks (the second compiled on request, and applied twice on
    request: one compiled region run twice a step), a head."""

    def __init__(self, compiled: bool, twice: bool = False) -> None:
        super().__init__()
        self.twice = twice
        self.emb, self.head = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        if compiled:
            self.blocks[1] = torch.compile(self.blocks[1], backend="aot_eager")

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = self.emb(batch[0])
        for block in self.blocks:
            x = block(x)
        if self.twice:
            x = self.blocks[1](x)
        logits = self.head(x).flatten(0, 1)
        return torch.nn.functional.cross_entropy(logits, batch[0].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        tokens = torch.randint(0, 50, (16, 8), generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)


def _blocks_fit(
    root: Path, compiled: bool, twice: bool = False
) -> dict[str, list[tuple[int, float]]]:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _TwoBlocks(compiled, twice)
    trainer = make_trainer(root, max_steps=4, log_every_n_steps=2, callbacks=[GradFlowCallback()])
    trainer.fit(model)
    assert hooks_left(model) == []
    assert not counters["graph_break"], dict(counters["graph_break"])
    return read_scalars(root)


# Dynamo's own read of the compiled block's input (a non-leaf), with or without the callback.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_compiled_attention_block_among_eager_ones_matches_eager(tmp_path: Path) -> None:
    """One of two residual attention blocks compiled: its layers' output-gradient hooks run in
    the compiled backward, after the eager head's; the grad_flow values equal eager's."""
    _assert_compiled_equals_eager(tmp_path, twice=False)


# Dynamo's own read of the compiled block's input (a non-leaf), with or without the callback.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_a_compiled_block_applied_twice_a_step_matches_eager(tmp_path: Path) -> None:
    """The compiled block run twice in one forward: the second call's backward, which runs
    first, must not write the tensor the first call's backward saved (its region gets fresh
    ones); the output-gradient norms sum both calls, as eager's do."""
    _assert_compiled_equals_eager(tmp_path, twice=True)


def _assert_compiled_equals_eager(tmp_path: Path, twice: bool) -> None:
    eager = _blocks_fit(tmp_path / "eager", compiled=False, twice=twice)
    compiled = _blocks_fit(tmp_path / "compiled", compiled=True, twice=twice)
    tags = {t for t in eager if t.startswith("grad_flow/")}
    assert "grad_flow/output_grad_norm/blocks.1.proj" in tags
    assert {t for t in compiled if t.startswith("grad_flow/")} == tags
    for tag in tags:
        for (step, got), (at, want) in zip(compiled[tag], eager[tag], strict=True):
            assert step == at and math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-9), tag
