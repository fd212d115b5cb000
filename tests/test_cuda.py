"""On a CUDA device, through a real ``Trainer.fit``: a quiet step makes no host sync beyond what
bare training makes (counted by CUDA's own sync-debug mode, not by our wrappers), an alarm
still names the step of its fault although the rules read the device's copy a step late, and
the CPU suite's exactness tests pass with the fit on the device (the multi-tensor reads, the
device-sized pieces, the output-gradient norms summed at the record).

Skipped without CUDA; ``benchmarks/gpu_session.sh`` runs it on a GPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import test_activation_stats
import test_dead_relu
import test_grad_flow
import test_saturation
import torch

from lightning_hooks import (
    ActivationStatsCallback,
    AlarmRules,
    DeadReLUCallback,
    GradFlowCallback,
    LayerTimeCallback,
    SaturationCallback,
    TrainingAlarmWarning,
)

from conftest import make_trainer
from support import SPIKE_WARNS, DeeperMLP, Fault, alarm_warnings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SYNC = "synchroniz"  # CUDA's sync-debug warning: "called a synchronizing CUDA operation"


class CudaSyncs(pl.Callback):
    """Counts CUDA's sync-debug warnings per step: ``per_step[s]`` from the start of step ``s``
    to the start of step ``s + 1`` (the optimizer step and every callback hook between)."""

    def __init__(self) -> None:
        self.record: list[warnings.WarningMessage] = []
        self.per_step: dict[int, int] = {}
        self._step: int | None = None
        self._seen = 0

    def _syncs(self) -> int:
        return sum(SYNC in str(w.message) for w in self.record)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        total = self._syncs()
        if self._step is not None:
            self.per_step[self._step] = total - self._seen
        self._step, self._seen = trainer.global_step, total


def _count(callbacks: list[pl.Callback], steps: int, tmp_path: Any) -> dict[int, int]:
    probe = CudaSyncs()
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        accelerator="cuda",
        devices=1,
        max_steps=steps,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[probe, *callbacks],
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        probe.record = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.fit(DeeperMLP(batches=steps))  # sets of gradients the default read stacks
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return probe.per_step


def test_a_quiet_step_makes_no_cuda_sync_beyond_bare_training(tmp_path: Any) -> None:
    """Every callback at its defaults, Trainer defaults (``log_every_n_steps=50``): steps 1-48
    hold no logging step, and make exactly bare training's syncs."""
    every = [
        GradFlowCallback(),
        ActivationStatsCallback(),
        DeadReLUCallback(),
        SaturationCallback(),
        LayerTimeCallback(),
    ]
    bare = _count([], 60, tmp_path / "bare")
    ours = _count(every, 60, tmp_path / "ours")
    quiet = range(1, 49)
    assert [ours[s] for s in quiet] == [bare[s] for s in quiet]
    # and the sync counter works: a logging step of ours reads its statistics back
    assert sum(ours.values()) > sum(bare.values())


EXACTNESS: dict[str, tuple[Callable[..., None], dict[str, Any]]] = {
    # the CPU suite's tests of logged values against plain torch, run with the fit on CUDA
    "grad-flow-accumulate-2": (
        test_grad_flow.test_logged_values_equal_an_independent_computation,
        {"accumulate": 2},
    ),
    "grad-flow-large-layers": (
        test_grad_flow.test_large_layers_logged_values_equal_an_independent_computation_at_defaults,
        {},
    ),
    "activations": (
        test_activation_stats.test_logged_statistics_equal_plain_torch_over_each_epoch,
        {"inplace": False},
    ),
    "activations-large-fused": (
        test_activation_stats.test_large_outputs_logged_statistics_equal_plain_torch,
        {"options": {"every_n_steps": 1, "fused": True}, "logging_step": 2},
    ),
    "dead-relu": (
        test_dead_relu.test_k_of_n_dead_and_zero_fraction_equal_plain_torch,
        {"activation": torch.nn.ReLU, "inplace": True},
    ),
    "saturation": (test_saturation.test_saturated_layers_match_plain_torch_and_warn, {}),
}


@pytest.mark.parametrize("name", list(EXACTNESS))
def test_exactness_holds_on_cuda(name: str, tmp_path: Path) -> None:
    test, arguments = EXACTNESS[name]

    def on_cuda(**options: Any) -> pl.Trainer:
        return make_trainer(tmp_path, **{"accelerator": "cuda", **options})

    test(trainer_factory=on_cuda, tmp_path=tmp_path, **arguments)


def _counting_reads(monkeypatch: pytest.MonkeyPatch, compare: bool, read: str) -> list[Any]:
    """Each call of the pointer-table read (``read="triton"``) or of the grouped read (else);
    with ``compare``, its norms beside ``_foreach_norm``'s of the same gradients."""
    from lightning_hooks.core.ops import grouped_norms
    from lightning_hooks.core.ops.grouped_norms import GroupedNorms
    from lightning_hooks.core.ops.pointer_norms import PointerNorms

    cls: Any = PointerNorms if read == "triton" else GroupedNorms
    # stacks of DeeperMLP's 3 and 4 gradients of one shape, as on the CPU (a CUDA read stacks
    # 12 at least: fewer are not worth their ops, and this model has none)
    monkeypatch.setitem(grouped_norms.MIN_GROUP, "cuda", 3)
    calls: list[Any] = []
    call = cls.__call__

    def counted(self: Any, grads: Any) -> torch.Tensor | None:
        norms = call(self, grads)
        want = torch.stack(torch._foreach_norm(grads)).float() if compare else None
        got = None if norms is None else norms.float().clone()  # a buffer the next read reuses
        calls.append((got, want) if compare else getattr(self, "groups", 1))
        return norms

    monkeypatch.setattr(cls, "__call__", counted)
    return calls


@pytest.mark.parametrize("read", ["grouped", "triton"])
def test_each_read_makes_no_cuda_sync_beyond_bare_training(
    read: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _counting_reads(monkeypatch, compare=False, read=read)
    bare = _count([], 60, tmp_path / "bare")
    ours = _count([GradFlowCallback(alarms=AlarmRules(quiet_read=read))], 60, tmp_path / "t")
    quiet = range(1, 49)
    assert [ours[s] for s in quiet] == [bare[s] for s in quiet]
    assert len(calls) >= 48  # the read ran on every quiet step: no fallback
    if read == "grouped":  # the hidden layers' biases and 16 x 16 weights, each in a stack
        assert calls[0] == [[1, 3, 5, 7], [2, 4, 6]]


@pytest.mark.parametrize("read", ["grouped", "triton"])
def test_a_spike_on_cuda_is_named_at_its_own_step(
    read: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rules read a non-blocking copy of the norms at most one step late: the warning still
    names the step of the fault, and the layer. With ``quiet_read="triton"`` or ``"grouped"``
    every quiet step's norms come from that read (none falls back), equal to ``_foreach_norm``'s
    of the same gradients up to float32 rounding (the reductions' order differs on CUDA)."""
    calls = _counting_reads(monkeypatch, compare=True, read=read)
    rules = AlarmRules(diverge_ratio=None, quiet_read=read)
    with pytest.warns(TrainingAlarmWarning) as record:
        pl.Trainer(
            default_root_dir=tmp_path,
            accelerator="cuda",
            devices=1,
            max_steps=40,
            enable_progress_bar=False,
            enable_checkpointing=False,
            callbacks=[
                Fault("multiply", step=37),
                GradFlowCallback(alarms=rules, on_alarm=SPIKE_WARNS),
            ],
        ).fit(DeeperMLP(batches=40))
    assert not [w for w in record if "quiet_read" in str(w.message)]
    assert len(calls) >= 38
    for got, want in calls:
        # past 1e19 the squares overflow float32: inf here (on CUDA in _foreach_norm too)
        big = ~(want < 1e19)
        torch.testing.assert_close(got[~big], want[~big], rtol=1e-5, atol=0)
        assert torch.equal(~(got < 1e19), big)
    alarms = alarm_warnings(record)
    assert min(step for step, _, _ in alarms) == 37
    assert next((s, layer) for s, layer, m in alarms if "spike" in m) == (37, "net.2")
