"""Every kind of hook the library installs goes through the guard: a failure of ours in any of
them, in turn, leaves the user's fit running to its end, with one warning that names the
callback and the failure, every hook removed and torch's mode stack as it was.

The model is a small ``TransformerEncoderLayer`` classifier, so that the attention capture's
torch-function mode, its hooks and the hooks that run plain layers outside it are all on the
path; the five callbacks that measure during the step run at their defaults.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import (
    FeatureMapCallback,
    GradFlowCallback,
    LightningHooksWarning,
    internals,
)
from lightning_hooks.callbacks.base import HookCallback
from lightning_hooks.core.hooks.guard import STRICT_ENV, guarded
from lightning_hooks.core.hooks.registry import HookRegistry
from lightning_hooks.core.stats import output_grad
from lightning_hooks.core.stats.activation_stats import ActivationStatsTracker
from lightning_hooks.core.stats.grad_flow import GradFlowTracker
from lightning_hooks.core.stats.stability import StabilityStats

from conftest import default_callback_types, hooks_left, make_trainer

STEPS = 6


class BoomError(RuntimeError):
    pass


class Encoder(pl.LightningModule):
    """One ``TransformerEncoderLayer`` over 6 tokens of 8 features, then a Tanh head to 3
    classes: attention, ReLUs and a bounded activation, so every callback has work."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(
            8, 2, 16, dropout=0.0, activation=nn.ReLU(), batch_first=True
        )
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4 * STEPS, 6, 8, generator=g)
        y = torch.randint(0, 3, (4 * STEPS,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=4)


def _callbacks() -> list[pl.Callback]:
    """Every callback at its defaults but the feature maps (drawn at epoch ends only)."""
    return [cls() for cls in default_callback_types() if cls is not FeatureMapCallback]


def _raising(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def patched(*args: Any, **kwargs: Any) -> Any:
        raise BoomError(f"injected in {original.__name__}")

    return patched


def _compile_check_raising_in(caller: str) -> Callable[[], bool]:
    """``internals.is_compiling``, raising when ``caller`` (a function of the library) calls it:
    a failure of the library's own part of a hook, after which the hook must still leave
    torch's mode stack as it was."""
    original = internals.is_compiling

    def patched() -> bool:
        if sys._getframe(1).f_code.co_name == caller:
            raise BoomError(f"injected in {caller}")
        return original()

    return patched


class Fault(NamedTuple):
    """A failure of one kind of hook, and the warning it must give."""

    owner: Any  # what is patched: a class or a module (``internals``: its compile check)
    attr: str  # the attribute that raises (for ``internals``: the library's function inside
    # which the compile check raises)
    callback: str  # the callback the warning names
    where: str  # the hook the warning names

    def inject(self, monkeypatch: pytest.MonkeyPatch) -> None:
        if self.owner is internals:  # the compile check, raising in the hook named by ``attr``
            monkeypatch.setattr(internals, "is_compiling", _compile_check_raising_in(self.attr))
            return
        patched = _raising(getattr(self.owner, self.attr))
        if isinstance(self.owner, type) and issubclass(self.owner, HookCallback):
            patched = guarded(patched)  # a Lightning hook patched on the class, guarded as ours
        monkeypatch.setattr(self.owner, self.attr, patched)


KINDS = {
    "torch-function mode": Fault(internals, "look", "GradFlowCallback", "attention capture"),
    "forward pre-hook that enters the mode": Fault(
        internals, "_enter", "GradFlowCallback", "forward pre-hook on '"
    ),
    "forward hook that leaves the mode": Fault(
        internals, "_pop", "GradFlowCallback", "forward hook on '"
    ),
    "pre-hook that runs a layer outside the mode": Fault(
        internals, "suspend", "GradFlowCallback", "forward pre-hook on 'encoder."
    ),
    "hook that puts the mode back": Fault(
        internals, "resume", "GradFlowCallback", "forward hook on 'encoder."
    ),
    "forward hook": Fault(ActivationStatsTracker, "observe", "ActivationStatsCallback", "forward"),
    "tensor (backward) hook": Fault(
        output_grad, "_output_norm", "GradFlowCallback", "output gradient hook"
    ),
    "optimizer step hook": Fault(
        GradFlowTracker, "_after_step", "GradFlowCallback", "optimizer step post-hook"
    ),
    "Lightning hook": Fault(
        GradFlowTracker, "observe", "GradFlowCallback", "on_before_optimizer_step hook"
    ),
    # A fit's set-up that fails after the tracker hooked the model: its hooks come off too.
    "set-up": Fault(StabilityStats, "attach", "GradFlowCallback", "on_train_start hook"),
    # The tracker's own construction, failing after its output-gradient hooks went on.
    "tracker's construction": Fault(
        HookRegistry, "optimizer_step_post_hook", "GradFlowCallback", "on_train_start hook"
    ),
    "state_dict": Fault(GradFlowCallback, "state_dict", "GradFlowCallback", "state_dict hook"),
    "on_train_end": Fault(
        GradFlowCallback, "on_train_end", "GradFlowCallback", "on_train_end hook"
    ),
    "teardown": Fault(GradFlowCallback, "teardown", "GradFlowCallback", "teardown hook"),
}


def _fit(tmp_path: Path, **trainer_options: Any) -> tuple[Encoder, list[str]]:
    """Fit the encoder with the five callbacks; the library's warnings."""
    model = Encoder()
    options: dict[str, Any] = {"callbacks": _callbacks(), "log_every_n_steps": 2}
    options.update(trainer_options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, **options).fit(model)
    ours = [str(w.message) for w in caught if issubclass(w.category, LightningHooksWarning)]
    return model, ours


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_of_hook_that_raises_leaves_the_fit_running(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STRICT_ENV, "0")
    fault = KINDS[kind]
    fault.inject(monkeypatch)
    model, ours = _fit(tmp_path, enable_checkpointing=kind == "state_dict")
    assert model.trainer.global_step == STEPS  # the fit ran to its end
    assert len(ours) == 1, ours
    assert ours[0].startswith(f"{fault.callback} is disabled"), ours
    assert fault.where in ours[0], ours
    assert f"BoomError: injected in {fault.attr}" in ours[0], ours
    assert hooks_left(model) == []
    assert not model.trainer.optimizers[0]._optimizer_step_post_hooks
    assert torch._C._len_torch_function_stack() == 0  # the mode stack as it was


def test_a_failing_compile_check_on_every_hook_leaves_the_fit_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failure first seen on an older torch: the library's compile check raises wherever it
    is called. Each callback that calls it says so once; the fit runs to its end."""
    monkeypatch.setenv(STRICT_ENV, "0")
    monkeypatch.setattr(internals, "is_compiling", _raising(internals.is_compiling))
    model, ours = _fit(tmp_path)
    assert model.trainer.global_step == STEPS
    named = sorted(message.split(" is disabled")[0] for message in ours)
    assert named == sorted(set(named)), ours  # one warning per callback
    assert "GradFlowCallback" in named and "ActivationStatsCallback" in named, ours
    assert all("BoomError: injected in is_compiling" in message for message in ours), ours
    assert hooks_left(model) == []
    assert torch._C._len_torch_function_stack() == 0


def test_an_error_of_the_users_own_op_reaches_the_user_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside the attention capture's mode only the library's part is guarded."""
    monkeypatch.setenv(STRICT_ENV, "0")

    class Failing(Encoder):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = self.encoder(x)
            return torch.matmul(hidden, torch.ones(5, 3)).mean(dim=1)  # 8 x 5: a shape error

    model = Failing()
    trainer = make_trainer(tmp_path, callbacks=_callbacks())
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        trainer.fit(model)
    assert hooks_left(model) == []
    assert torch._C._len_torch_function_stack() == 0


def test_an_exception_hook_that_fails_does_not_replace_the_users_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STRICT_ENV, "0")
    Fault(GradFlowCallback, "on_exception", "GradFlowCallback", "").inject(monkeypatch)

    class Failing(Encoder):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == 3:
                raise ValueError("the user's own error")
            return super().training_step(batch, batch_idx)

    model = Failing()
    warned = pytest.warns(LightningHooksWarning, match=r"GradFlowCallback.*on_exception hook")
    with warned, pytest.raises(ValueError, match="the user's own error"):
        make_trainer(tmp_path, callbacks=_callbacks()).fit(model)
    assert hooks_left(model) == []
