"""The hook registry and module selection, in a plain PyTorch loop."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from lightning_hooks import HookRegistry, select_modules

from conftest import hooks_left


def _model() -> nn.Sequential:
    return nn.Sequential(
        nn.Sequential(nn.Linear(4, 4), nn.ReLU()),
        nn.Sequential(nn.Linear(4, 4), nn.ReLU()),
        nn.Linear(4, 1),
    )


def test_select_by_type_include_exclude() -> None:
    model = _model()
    assert [n for n, _ in select_modules(model, types=nn.Linear)] == ["0.0", "1.0", "2"]
    assert [n for n, _ in select_modules(model, include="1.*")] == ["1.0", "1.1"]
    assert [n for n, _ in select_modules(model, types=nn.Linear, exclude=["2", "0.*"])] == ["1.0"]
    relu = select_modules(model, where=lambda name, m: isinstance(m, nn.ReLU))
    assert [n for n, _ in relu] == ["0.1", "1.1"]


def test_pattern_matching_nothing_names_the_closest_modules() -> None:
    named = r"select_modules\(include='1\.O'\) matches no module.*'1\.0'"
    with pytest.raises(ValueError, match=named):
        select_modules(_model(), include="1.O")
    with pytest.raises(ValueError, match=r"select_modules\(exclude='encoder'\) matches no module"):
        select_modules(_model(), exclude="encoder")


def test_pattern_of_wrong_type_is_refused() -> None:
    with pytest.raises(
        TypeError,
        match=r"select_modules\(include=\[3\]\): must be a glob pattern \(str\), a sequence of "
        r"them, or None, got 3",
    ):
        select_modules(_model(), include=[3])  # type: ignore[list-item]


def test_shared_module_is_selected_once() -> None:
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    assert [n for n, _ in select_modules(model, types=nn.Linear)] == ["0"]


def test_context_manager_removes_every_hook_and_remove_is_idempotent() -> None:
    model = _model()
    calls: list[str] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookRegistry(model) as hooks:
        for name, module in hooks.modules(types=nn.Linear):
            hooks.forward_hook(module, lambda m, a, o, name=name: calls.append(name))
            hooks.forward_pre_hook(module, lambda m, a: None)
        hooks.optimizer_step_post_hook(opt, lambda o, a, k: None)
        assert len(hooks) == 7
        model(torch.randn(3, 4)).sum().backward()
    assert calls == ["0.0", "1.0", "2"]
    assert hooks_left(model) == []
    assert not opt._optimizer_step_post_hooks
    assert len(hooks) == 0
    hooks.remove()
    hooks.remove()


def test_registry_removes_hooks_when_the_loop_raises() -> None:
    model = _model()
    with pytest.raises(RuntimeError, match="loop failed"), HookRegistry(model) as hooks:
        hooks.forward_hook(model[2], lambda m, a, o: None)
        raise RuntimeError("loop failed")
    assert hooks_left(model) == []


def test_remove_lets_the_model_go_and_is_safe_after_it_is_gone() -> None:
    model = _model()
    hooks = HookRegistry(model)
    hooks.forward_hook(model[2], lambda m, a, o: None)
    gone = weakref.ref(model)
    hooks.remove()
    del model
    gc.collect()
    assert gone() is None and len(hooks) == 0
    hooks.remove()
    with pytest.raises(RuntimeError, match="HookRegistry: removed; it no longer holds the model"):
        hooks.modules()


def test_a_guarded_registry_turns_hook_errors_into_one_warning() -> None:
    from lightning_hooks import LightningHooksWarning
    from lightning_hooks.core.hooks.guard import Guard

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    guard = Guard("Demo", strict=False)
    registry = HookRegistry(model, guard=guard)

    def broken(module: nn.Module, args: Any, output: Any) -> None:
        raise KeyError("no such row")

    registry.forward_hook(model[0], broken, gated=True)
    registry.forward_hook(model[1], broken)
    with pytest.warns(
        LightningHooksWarning, match=r"Demo is disabled.*forward hook on '0'.*KeyError"
    ):
        out = model(torch.ones(3, 2))
    assert out.shape == (3, 2)  # the forward went on, output untouched
    assert guard.failed is not None and guard.removal_due() and not guard.removal_due()
    model(torch.ones(3, 2))  # later failures are silent (warnings are errors in this suite)
    registry.remove()
    assert not model[0]._forward_hooks and not model[1]._forward_hooks


def test_scripted_modules_get_no_module_hook() -> None:
    import warnings

    from lightning_hooks import LightningHooksWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(nn.Sequential(nn.Linear(2, 2)))
    model = nn.Sequential(nn.Linear(2, 2), scripted)
    registry = HookRegistry(model)
    with pytest.warns(LightningHooksWarning, match=r"Sequential: 2 selected module\(s\).*1, 1.0"):
        selected = registry.modules()
    assert [name for name, _ in selected] == ["0", "1", "1.0"]  # parameters still measurable
    handles = [registry.forward_hook(m, lambda *a: None) for _, m in selected]
    assert [h is not None for h in handles] == [True, False, False]
    registry.remove()


def _hooked(module: nn.Module) -> int:
    return len(module._forward_hooks) + len(module._forward_pre_hooks)


def test_gated_hooks_are_on_the_modules_only_on_logging_steps() -> None:
    model = _model()
    seen: list[str] = []
    with HookRegistry(model) as hooks:
        for name, module in hooks.modules(types=nn.Linear):
            hooks.forward_hook(module, lambda m, a, o, name=name: seen.append(name), gated=True)
            hooks.forward_pre_hook(module, lambda m, a: None, gated=True)
        assert not hooks.fixed
        assert [_hooked(m) for m in (model[0][0], model[2])] == [2, 2]
        hooks.set_logging_step(False)
        assert hooks_left(model) == []  # a quiet step runs no hook of ours
        assert len(hooks) == 6  # kept for the next logging step
        model(torch.ones(1, 4))
        hooks.set_logging_step(True)
        hooks.set_logging_step(True)  # idempotent: installed once
        assert _hooked(model[2]) == 2
        model(torch.ones(1, 4))
        assert seen == ["0.0", "1.0", "2"]
        hooks.set_logging_step(False)
        hooks.set_logging_step(True)
    assert hooks_left(model) == []
    assert len(hooks) == 0


def test_a_gated_hook_registered_on_a_quiet_step_waits_for_the_next_logging_step() -> None:
    model = _model()
    with HookRegistry(model) as hooks:
        hooks.set_logging_step(False)
        assert hooks.forward_hook(model[2], lambda m, a, o: None, gated=True) is None
        assert _hooked(model[2]) == 0
        hooks.set_logging_step(True)
        assert _hooked(model[2]) == 1


@pytest.mark.parametrize("how", ["submodule", "in_place"])
def test_under_torch_compile_the_gated_hooks_stay_and_check_the_flag(how: str) -> None:
    model = _model()
    if how == "submodule":
        model[1] = torch.compile(model[1], backend="eager")  # type: ignore[assignment]
    else:
        model[1].compile(backend="eager")
    seen: list[int] = []
    with HookRegistry(model) as hooks:
        assert hooks.fixed  # a changing hook set would recompile
        hooks.forward_hook(model[2], lambda m, a, o: seen.append(1), gated=True)
        hooks.set_logging_step(False)
        assert _hooked(model[2]) == 1
        with torch.no_grad():  # Dynamo warns of .grad reads while tracing a grad-mode forward
            model(torch.ones(1, 4))
            assert seen == [] and len(hooks) == 1
            hooks.set_logging_step(True)
            model(torch.ones(1, 4))
        assert seen == [1]
    assert hooks_left(model) == []


def test_gated_hooks_of_every_registry_run_outside_the_attention_mode() -> None:
    """The attention capture's mode sees the model's own calls on a logging step's forward, not
    the torch calls of gated hooks, its registry's or another's (each callback has its own), nor
    those of ``torch.nn``'s plain layers, which run outside it: they would cost a Python call
    each and are never the model's attention. The calls a module of the user's makes are still
    seen, its scaled dot product recorded, and the hooks still measure."""
    from torch.nn import functional

    from lightning_hooks.core.stats import attention

    class Attend(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.tanh(x)
            return functional.scaled_dot_product_attention(x, x, x)

    model = nn.Sequential(nn.Linear(4, 4), Attend(), nn.ReLU())
    seen: list[str] = []
    inner = attention.AttentionCapture.__torch_function__

    def counting(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        seen.append(getattr(func, "__name__", str(func)))
        return inner(self, func, types, args, kwargs)

    measured: list[float] = []

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        measured.append(float(output.detach().abs().amax().cpu()))

    logits: list[str] = []
    with HookRegistry(model) as own, HookRegistry(model) as other:
        attention.AttentionCapture(lambda name, z: logits.append(name)).attach(own)
        own.forward_hook(model[0], hook, gated=True)
        other.forward_hook(model[1], hook, gated=True)  # in the mode's reach: the user's module
        other.forward_hook(model[2], hook, gated=True)
        attention.AttentionCapture.__torch_function__ = counting  # type: ignore[method-assign]
        try:
            model(torch.randn(2, 3, 4))
        finally:
            attention.AttentionCapture.__torch_function__ = inner  # type: ignore[method-assign]
    assert logits == ["1"] and len(measured) == 3
    assert seen == ["tanh", "scaled_dot_product_attention"], seen
