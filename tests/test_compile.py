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
    # Modules in a compiled region get no instability statistics (core/stats/stability.py says why).
    assert "stability/logit_logz/net.4" in eager
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
