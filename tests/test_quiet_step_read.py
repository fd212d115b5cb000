"""``AlarmRules(quiet_read=...)``: the argument is checked at construction, and where the
chosen read cannot run (here: no CUDA, or no Triton; a stack that fails) the quiet steps read
with ``_foreach_norm``, after one message, and the alarms are those of the default read. On a
GPU, ``tests/test_cuda.py`` runs the read itself through ``Trainer.fit``."""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from lightning_hooks import AlarmRules, GradFlowCallback, LightningHooksWarning
from lightning_hooks.core.alarms.rules import QUIET_READS
from lightning_hooks.core.ops.grouped_norms import GroupedNorms
from lightning_hooks.core.stats import alarm_feed

from support import SPIKE_WARNS, DeeperMLP, Fault, LongMLP, alarm_warnings


def test_an_unknown_read_is_named_with_the_allowed_ones() -> None:
    allowed = re.escape(str(QUIET_READS))
    with pytest.raises(ValueError, match=r"quiet_read='cuda-graph'.*" + allowed):
        AlarmRules(quiet_read="cuda-graph")


def test_a_misspelt_read_is_answered_with_the_closest_allowed_one() -> None:
    with pytest.raises(ValueError, match=r"quiet_read='groupd'.*\(did you mean 'grouped'\?\)"):
        AlarmRules(quiet_read="groupd")


class _Foreach(GroupedNorms):
    """The reference read: one ``_foreach_norm`` of every gradient."""

    def __call__(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack(torch._foreach_norm(list(grads)))


def _foreach(root: Path, model: type[LongMLP] = LongMLP) -> list[tuple[int, str, str]]:
    """The alarms of a fit whose quiet steps read with one ``_foreach_norm``, without a word."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(alarm_feed, "GroupedNorms", _Foreach)
        alarms, said = _fit("grouped", root, model)
    assert not [m for m in said if "quiet_read" in m], said
    return alarms


def _fit(
    read: str, root: Path, model: type[LongMLP] = LongMLP
) -> tuple[list[tuple[int, str, str]], list[str]]:
    torch.manual_seed(0)  # the same model and data for each read
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pl.Trainer(
            default_root_dir=root,
            accelerator="cpu",
            max_steps=40,
            enable_progress_bar=False,
            enable_checkpointing=False,
            callbacks=[
                Fault("multiply", step=33),
                GradFlowCallback(
                    alarms=AlarmRules(diverge_ratio=None, quiet_read=read), on_alarm=SPIKE_WARNS
                ),
            ],
        ).fit(model())
    said = [str(w.message) for w in record if w.category is LightningHooksWarning]
    return alarm_warnings(iter(record)), said


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback off CUDA")
def test_off_cuda_the_triton_read_falls_back_once_with_the_same_alarms(tmp_path: Path) -> None:
    foreach = _foreach(tmp_path / "foreach")
    triton, said_triton = _fit("triton", tmp_path / "triton")
    assert triton == foreach and min(step for step, _, _ in triton) == 33
    fallback = [m for m in said_triton if "quiet_read='triton'" in m]
    assert len(fallback) == 1 and "_foreach_norm" in fallback[0], said_triton
    assert "not CUDA" in fallback[0] or "triton" in fallback[0]


def test_kernels_that_fail_are_said_once_and_the_fit_reads_with_foreach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our failure is never the user's: a Triton that cannot launch (a driver without the
    kernels' image, say) costs one message, and the alarms are the default read's."""
    launches: list[int] = []

    class Broken:
        def __call__(self, grads: list[torch.Tensor]) -> torch.Tensor:
            launches.append(len(grads))
            raise RuntimeError("no kernel image is available for execution on the device")

    foreach = _foreach(tmp_path / "foreach")
    monkeypatch.setattr(alarm_feed, "_pointer_norms", lambda view: Broken())
    broken, said = _fit("triton", tmp_path / "triton")
    assert broken == foreach and len(launches) == 1
    fallback = [m for m in said if "quiet_read='triton'" in m]
    assert len(fallback) == 1, said
    assert "its kernels failed (RuntimeError: no kernel image" in fallback[0]


def test_the_grouped_read_gives_the_foreach_norms_alarms_without_a_word(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default read (small gradients of one shape stacked) and one ``_foreach_norm`` give
    the same norms, so the same alarms at the same steps."""
    calls: list[list[list[int]]] = []

    class Spy(GroupedNorms):  # the quiet read's (a logging step's CPU reads stack on their own)
        def __call__(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
            calls.append(self.groups)
            return super().__call__(grads)

    foreach = _foreach(tmp_path / "foreach", DeeperMLP)
    monkeypatch.setattr(alarm_feed, "GroupedNorms", Spy)
    grouped, said = _fit("grouped", tmp_path / "grouped", DeeperMLP)
    assert grouped == foreach and min(step for step, _, _ in grouped) == 33
    assert not [m for m in said if "quiet_read" in m], said
    assert len(calls) > 30 and calls[0] == [[1, 3, 5, 7], [2, 4, 6]]  # biases, 16 x 16 weights


def test_a_grouped_read_that_fails_is_said_once_and_the_fit_reads_with_foreach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gradient set by hand unlike its parameter cannot be stacked with its group's: one
    message, and the alarms are ``_foreach_norm``'s."""
    calls: list[int] = []

    class Broken(GroupedNorms):
        def __call__(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
            calls.append(len(grads))
            raise RuntimeError("stack expects each tensor to be equal size")

    foreach = _foreach(tmp_path / "foreach", DeeperMLP)
    monkeypatch.setattr(alarm_feed, "GroupedNorms", Broken)
    grouped, said = _fit("grouped", tmp_path / "grouped", DeeperMLP)
    assert grouped == foreach and len(calls) == 1
    fallback = [m for m in said if "quiet_read='grouped'" in m]
    assert len(fallback) == 1 and "stack expects each tensor" in fallback[0], said


def test_a_grouped_read_that_cannot_be_made_is_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: GroupedNorms, params: list[torch.Tensor]) -> None:
        raise RuntimeError("cannot pin memory")

    foreach = _foreach(tmp_path / "foreach", DeeperMLP)
    monkeypatch.setattr(GroupedNorms, "__init__", broken)
    grouped, said = _fit("grouped", tmp_path / "grouped", DeeperMLP)
    assert grouped == foreach
    fallback = [m for m in said if "quiet_read='grouped'" in m]
    assert len(fallback) == 1 and "could not be made (RuntimeError: cannot pin" in fallback[0]
