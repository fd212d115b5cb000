"""What instrumentation costs, measured exactly: syncs, ATen operations, memory, sampling.

Timings live in ``benchmarks/overhead.py`` (noisy, not a test); the counts here are exact and
deterministic, so they are guarded.
"""

from __future__ import annotations

import math
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from ops import OpCounter, OpsPerStep
from torch import nn

import lightning_hooks
from lightning_hooks import AlarmFeed, AlarmRules, GradFlowCallback, GradFlowTracker
from lightning_hooks.core import TrainingAlarms
from lightning_hooks.core.ops.grouped_norms import MAX_GROUPS
from lightning_hooks.errors import LightningHooksWarning

from conftest import (
    BoundedMLP,
    TinyMLP,
    default_callback_types,
    epoch_end_step,
    make_trainer,
    read_scalars,
)
from support import LAYERS, ReferenceMLP, StepWindow
from syncs import count_syncs

CALLBACKS = default_callback_types()


def test_no_host_sync_per_step_with_every_callback(
    trainer_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with count_syncs(monkeypatch) as counter:

        def start() -> None:
            counter.active = True

        def stop() -> None:
            counter.active = False

        window = StepWindow(start, stop)
        callbacks = [window, *(cls() for cls in CALLBACKS)]
        trainer_factory(callbacks=callbacks, max_epochs=2).fit(BoundedMLP())
    assert window.steps == 8
    assert dict(counter.calls) == {}


def test_op_counter_sees_operations_inside_backward_hooks() -> None:
    layer = nn.Linear(2, 2)
    out = layer(torch.ones(1, 2))

    def hook(grad: torch.Tensor) -> None:
        torch.linalg.vector_norm(grad)

    out.register_hook(hook)
    counter = OpCounter()
    with counter:
        out.sum().backward()
    assert counter.ops["linalg_vector_norm"] == 1


def _deep(depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(depth)])


def _ops_per_step(
    depth: int, tracked: bool, logging_step: bool = True, alarms: AlarmRules | None = None
) -> int:
    """ATen ops of one training step (after a warm-up step), with or without a tracker."""
    model = _deep(depth)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = GradFlowTracker(model, [opt]) if tracked else None
    feed = None if tracker is None or alarms is None else AlarmFeed(tracker, alarms)
    x = torch.randn(8, 4)
    counter = OpCounter()
    for i in range(2):
        if tracker is not None:
            tracker.registry.set_logging_step(logging_step)
        if i == 1:
            counter.start()
        opt.zero_grad()
        model(x).square().mean().backward()
        if tracker is not None:
            measured = tracker.observe(opt)
            if feed is not None:
                feed.observe(opt, measured)
        opt.step()
    counter.stop()
    if tracker is not None:
        tracker.remove()
    return counter.total


def test_operations_per_layer_are_constant_and_few() -> None:
    extra = {d: _ops_per_step(d, True) - _ops_per_step(d, False) for d in (4, 8, 12)}
    per_layer = (extra[8] - extra[4]) / 4
    assert extra[12] - extra[8] == extra[8] - extra[4]  # linear in depth, exactly
    # the output-gradient norm: the hit, its square's sum and the parameters' |g| sums and
    # maxima are multi-tensor ops over every layer
    assert per_layer == 1, extra


def test_a_quiet_step_dispatches_no_operation() -> None:
    for depth in (4, 16):
        assert _ops_per_step(depth, True, logging_step=False) == _ops_per_step(depth, False)


def test_the_every_step_check_is_the_norm_pass_and_one_copy_whatever_the_depth() -> None:
    """Quiet steps with the alarms on: one multi-tensor norm, a segment sum, one copy of the
    norms to the host; the rules run there."""
    extra = {
        d: _ops_per_step(d, True, logging_step=False, alarms=AlarmRules()) - _ops_per_step(d, False)
        for d in (4, 16)
    }
    assert extra[4] == extra[16] <= 14, extra


def _ops_of_each_call(
    values: list[torch.Tensor], call: Callable[..., None]
) -> list[dict[str, int]]:
    """ATen ops of ``call(value, step=step)`` for each value, after the first (whose post makes
    its views of the host buffer, once per shape)."""
    counter = OpCounter()
    ops = []
    for step, value in enumerate(values):
        counter.start()
        call(value, step=step)
        counter.stop()
        ops.append(dict(counter.ops))
        counter.ops.clear()
    return ops[1:]


def test_the_loss_rules_are_one_copy_a_step() -> None:
    """*diverging* on by default: the device copies the loss to the host, where the rules run
    (one copy, no other op)."""
    alarms = TrainingAlarms(["a", "b", "global"], AlarmRules())
    losses = [torch.tensor(1.0 - 0.1 * step) for step in range(3)]
    assert _ops_of_each_call(losses, alarms.update_loss) == [{"copy_": 1}] * 2
    assert alarms.poll() == []


def test_the_gradient_rules_launch_no_kernel() -> None:
    """:meth:`TrainingAlarms.update` is one copy of the norms, whatever fires."""
    alarms = TrainingAlarms(["a", "b", "global"], AlarmRules(min_history=3))
    norms = [[1.0, 2.0, 2.2], [1.1, 2.1, 2.4], [0.9, 1.9, 2.1], [1.0, 200.0, 200.0]]
    values = [torch.tensor(norm) for norm in norms]
    assert _ops_of_each_call(values, alarms.update) == [{"copy_": 1}] * 3
    assert [(a.rule, a.layer, a.step) for a in alarms.poll()] == [("spike", "b", 3)]


def test_a_callbacks_quiet_steps_cost_what_bare_steps_cost(trainer_factory: Any) -> None:
    bare, logging_step, alarmed = OpsPerStep(), OpsPerStep(), OpsPerStep()
    trainer_factory(callbacks=[bare]).fit(TinyMLP())
    quiet = GradFlowCallback(every_n_steps=2, alarms=False)
    trainer_factory(callbacks=[logging_step, quiet]).fit(TinyMLP())
    watched = GradFlowCallback(every_n_steps=2, alarms=AlarmRules(evaluate_every_n_steps=1))
    trainer_factory(callbacks=[alarmed, watched]).fit(TinyMLP())
    assert len(bare.per_step) == len(logging_step.per_step) == len(alarmed.per_step) == 4
    # every_n_steps=2 over steps 0-3: steps 0 (the epoch's first), 1 and 3 are logging steps.
    assert logging_step.per_step[2] == bare.per_step[2]
    assert logging_step.per_step[1] > bare.per_step[1]
    assert logging_step.per_step[3] > bare.per_step[3]
    # Alarms on every step: quiet steps pay the norms and the rules, not the full statistics.
    extra = [a - b for a, b in zip(alarmed.per_step, bare.per_step, strict=True)]
    assert 0 < extra[2] < min(extra[1], extra[3])


def _held_tensors(obj: Any, seen: set[int] | None = None) -> dict[int, torch.Tensor]:
    """Every tensor reachable from ``obj`` through the library's own objects and containers."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return {}
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return {id(obj): obj}
    if isinstance(obj, nn.Module) and not type(obj).__module__.startswith("lightning_hooks"):
        return {}  # the user's model, not ours
    found: dict[int, torch.Tensor] = {}
    if isinstance(obj, dict):
        children: list[Any] = list(obj.values())
    elif isinstance(obj, list | tuple | set):
        children = list(obj)
    elif type(obj).__module__.startswith("lightning_hooks"):
        children = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
        children += [getattr(obj, s) for s in getattr(type(obj), "__slots__", ())]
    else:
        return {}
    for child in children:
        found.update(_held_tensors(child, seen))
    return found


class _MemoryProbe(pl.Callback):
    """Bytes of tensors the watched callback holds, at each epoch end, after its logging."""

    def __init__(self, watched: pl.Callback) -> None:
        self.watched = watched
        self.bytes: list[int] = []
        self.accumulator: list[int] = []
        self.alarm_bytes: list[int] = []

    def on_train_epoch_end(self, *args: Any) -> None:
        held = _held_tensors(self.watched).values()
        params = {id(p) for p in args[1].parameters()}
        self.bytes.append(_storage_bytes(t for t in held if id(t) not in params))
        fit = self.watched._fit  # type: ignore[attr-defined]
        tracker = fit.tracker
        self.accumulator.append(sum(getattr(tracker, n).numel() for n in tracker.specs))
        self.alarm_bytes.append(_storage_bytes(_held_tensors(fit.alarms.training_alarms).values()))


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each counted once (views of a buffer are free)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_memory_is_layers_times_stats_and_flat_over_ten_epochs(trainer_factory: Any) -> None:
    callback = GradFlowCallback(chart=False)
    probe = _MemoryProbe(callback)
    trainer_factory(callbacks=[callback, probe], max_epochs=10, limit_train_batches=2).fit(
        TinyMLP()
    )
    assert len(probe.bytes) == 10
    assert len(set(probe.bytes)) == 1, probe.bytes
    stats = len(lightning_hooks.core.GRAD_FLOW_STATS)
    assert set(probe.accumulator) == {3 * (len(LAYERS) + 1) * stats}  # total, peak, count
    params = sum(p.numel() for p in TinyMLP().parameters()) * 4
    # The alarms: running scales and the ring buffer of the last `history` steps (norm, scale,
    # band), O(history x layers) whatever the number of steps, plus the host copy; the loss
    # rules' report, which holds diverging's state, and its host copy (8 floats each).
    rows = len(LAYERS) + 1
    assert probe.alarm_bytes[0] <= ((AlarmRules().history * 3 + 24) * rows + 16) * 4
    # Beyond the accumulator: one copy of the parameters (update ratio), O(layers) buffers.
    assert probe.bytes[0] - probe.alarm_bytes[0] <= params + 64 * (len(LAYERS) + 1) * stats


class _RefMLP(BoundedMLP):
    """Keeps weak references to every activation and activation gradient of each step."""

    def __init__(self, leak: bool = False) -> None:
        super().__init__()
        self.refs: list[weakref.ref[torch.Tensor]] = []
        self.leak = leak
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self.net:
            x = module(x)
            self.refs.append(weakref.ref(x))
            if x.requires_grad:
                x.register_hook(self._grad_ref)
            if self.leak:
                self.kept.append(x)
        return x

    def _grad_ref(self, grad: torch.Tensor) -> None:
        self.refs.append(weakref.ref(grad))


class _AliveAtNextStep(pl.Callback):
    """At each batch start (and at the end), counts the previous step's tensors still alive."""

    def __init__(self) -> None:
        self.alive: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, model: Any, *args: Any) -> None:
        self._check(model)

    def on_train_end(self, trainer: pl.Trainer, model: Any) -> None:
        self._check(model)

    def _check(self, model: _RefMLP) -> None:
        if model.refs:
            self.alive.append(sum(ref() is not None for ref in model.refs))
        model.refs.clear()


@pytest.mark.parametrize("leak", [False, True])
def test_no_activation_or_gradient_outlives_its_step(trainer_factory: Any, leak: bool) -> None:
    probe, model = _AliveAtNextStep(), _RefMLP(leak=leak)
    callbacks = [GradFlowCallback(), *(cls() for cls in CALLBACKS if cls is not GradFlowCallback)]
    trainer_factory(callbacks=[probe, *callbacks]).fit(model)
    assert len(probe.alive) == 4
    if leak:  # the check can fail: a model that keeps its activations is caught
        assert all(n >= 5 for n in probe.alive)
    else:
        assert probe.alive == [0, 0, 0, 0]


# The default cadence is the Trainer's log_every_n_steps; an epoch's first step logs.
@pytest.mark.parametrize(
    ("options", "trainer_options"),
    [({"every_n_steps": 3}, {}), ({}, {"log_every_n_steps": 3})],
    ids=["every_n_steps=3", "log_every_n_steps=3"],
)
def test_every_n_steps_logs_the_mean_over_the_logging_steps(
    trainer_factory: Any, tmp_path: Path, options: dict[str, Any], trainer_options: dict[str, Any]
) -> None:
    model = ReferenceMLP()
    callback = GradFlowCallback(**options)
    trainer_factory(callbacks=[callback], max_epochs=2, **trainer_options).fit(model)
    scalars = read_scalars(tmp_path)
    for epoch, steps in ((0, [0, 2]), (1, [4, 5])):
        at = epoch_end_step(4 * (epoch + 1))
        for layer in LAYERS:
            for stat in ("grad_norm", "update_ratio", "output_grad_norm"):
                want = float(np.mean([model.steps[s][layer][stat] for s in steps]))
                logged = dict(scalars[f"grad_flow/{stat}/{layer}"])[at]
                assert math.isclose(logged, want, rel_tol=1e-5), (stat, layer, epoch)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_every_n_steps_must_be_a_positive_int(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"GradFlowCallback\(every_n_steps=.*\): must be a posi"):
        GradFlowCallback(every_n_steps=bad)


_OURS = str(Path(lightning_hooks.__file__).parent)


class _Chain(TinyMLP):
    """``modules`` modules in all, itself included, its children called in turn:
    ``modules - 4`` Linear and Tanh layers, then a Linear, a ReLU and a Tanh (4 modules: the
    smallest model every default callback watches)."""

    def __init__(self, modules: int) -> None:
        super().__init__(lr=0.01)
        del self.net
        body = [nn.Linear(8, 8) if i % 2 == 0 else nn.Tanh() for i in range(modules - 4)]
        head = nn.Linear(8, 1)
        for i, layer in enumerate([*body, head, nn.ReLU(), nn.Tanh()]):
            self.add_module(f"layer{i}", layer)
        # The head's ReLU unit alive, and orthogonal weights keeping the gradient's scale
        # through the depth: no layer's gradient falls below the vanishing floor, and both
        # depths take the every-step check's quiet path (one whose rules fire takes another).
        with torch.no_grad():
            head.weight.mul_(0.1)
            head.bias.fill_(1.0)
        for layer in body[::2]:
            nn.init.orthogonal_(layer.weight, gain=1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children():
            x = layer(x)
        return x


class _QuietSteps(OpsPerStep):
    """Per step: ATen ops by name, and calls of the library's Python functions."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[dict[str, int]] = []
        self.calls: list[int] = []
        self.modules: list[set[str]] = []  # our modules a step's calls ran in
        self._calls = 0
        self._modules: set[str] = set()

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(_OURS):
            self._calls += 1
            self._modules.add(frame.f_code.co_filename)

    def on_train_batch_start(self, *args: Any) -> None:
        super().on_train_batch_start(*args)
        self._calls, self._modules = 0, set()
        sys.setprofile(self._profile)

    def _close(self) -> None:
        if self.counter.running:
            sys.setprofile(None)
            self.ops.append(dict(self.counter.ops))
            self.calls.append(self._calls)
            self.modules.append(self._modules)
        super()._close()


def _quiet_steps(factory: Any, modules: int, callbacks: list[pl.Callback]) -> _QuietSteps:
    """Four steps; the Trainer logs every 50, so step 0 (the epoch's first) is the logging step."""
    probe = _QuietSteps()
    torch.manual_seed(0)  # module-scoped: the autouse seed has not run yet
    model = _Chain(modules)
    assert len(list(model.modules())) == modules
    with warnings.catch_warnings():  # 196 layers deep, the head's one ReLU unit dies
        warnings.filterwarnings("ignore", "DeadReLUCallback: layer .* dead", LightningHooksWarning)
        factory(callbacks=[probe, *callbacks], log_every_n_steps=50).fit(model)
    assert len(probe.per_step) == 4
    return probe


@pytest.fixture(scope="module")
def quiet_steps(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, bool], _QuietSteps]:
    """Bare and with every default callback, on 4, 100 and 200 modules."""
    root = tmp_path_factory.mktemp("quiet")
    factory = lambda **kwargs: make_trainer(root, **kwargs)  # noqa: E731
    return {
        (modules, tracked): _quiet_steps(
            factory, modules, [cls() for cls in CALLBACKS] if tracked else []
        )
        for modules in (4, 100, 200)
        for tracked in (False, True)
    }


def test_a_quiet_step_runs_no_python_of_ours_per_module(
    quiet_steps: dict[tuple[int, bool], _QuietSteps],
) -> None:
    small, deep = quiet_steps[4, True].calls, quiet_steps[200, True].calls
    assert deep[0] > small[0] + 200  # the logging step hooks every module: the count can fail
    assert small[1:] == quiet_steps[100, True].calls[1:] == deep[1:], (small, deep)
    assert quiet_steps[4, False].calls == [0, 0, 0, 0]


def test_a_quiet_step_reads_nothing_back_on_the_host(
    quiet_steps: dict[tuple[int, bool], _QuietSteps],
) -> None:
    for modules in (4, 200):
        for ops in quiet_steps[modules, True].ops[1:]:
            assert not {"_local_scalar_dense", "item", "nonzero"} & set(ops), ops


def test_a_quiet_step_is_a_constant_few_dozen_ops_whatever_the_depth(
    quiet_steps: dict[tuple[int, bool], _QuietSteps],
) -> None:
    """Every default callback, loss rules included: the parameters' norm pass, one copy of the
    norms and one of the loss to the host, where the norms are folded into layers and the rules
    run. The norm pass is one ``_foreach_norm`` and a stack when no three gradients
    share a shape (4 ops in all), else a stack and a norm per set of small gradients of one
    shape, at most ``MAX_GROUPS`` of them, one ``_foreach_norm`` and a stack for the rest, a cat
    and an index: on the deep chain 98 weights and 98 biases in two stacks (10 ops), on any
    model at most ``2 * MAX_GROUPS + 6``."""
    extra = {
        modules: [
            sum(ops.values()) - sum(bare.values())
            for ops, bare in zip(
                quiet_steps[modules, True].ops, quiet_steps[modules, False].ops, strict=True
            )
        ][1:]
        for modules in (4, 100, 200)
    }
    assert extra[100] == extra[200], extra
    assert max(extra[4]) <= 4 and max(extra[200]) <= 10 <= 2 * MAX_GROUPS + 6 <= 30, extra


class _Attend(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.unflatten(-1, (2, -1)).transpose(1, 2)  # two heads
        return nn.functional.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(-2)


class _AttendFit(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.ReLU(), _Attend())
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x)).mean(1)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        x, y = torch.randn(16, 5, 8), torch.randint(0, 3, (16,))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def test_the_attention_mode_sees_only_the_models_calls_on_a_logging_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every callback at its defaults through ``Trainer.fit``: on a forward of a logging step the
    attention capture's ``TorchFunctionMode`` sees what the model calls, not the torch calls of
    the statistics' hooks (on the launch-bound stand-in the model makes 73); the attention is
    still captured and logged."""
    from lightning_hooks.core.stats import attention

    model = _AttendFit()
    own: list[str] = []  # the calls of one training forward

    class Calls(torch.overrides.TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            own.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Calls():
        model.train()(torch.randn(4, 5, 8))
    seen: list[str] = []
    inner = attention.AttentionCapture.__torch_function__

    def counting(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        seen.append(getattr(func, "__name__", str(func)))
        return inner(self, func, types, args, kwargs)

    monkeypatch.setattr(attention.AttentionCapture, "__torch_function__", counting)
    callbacks = [cls() for cls in default_callback_types()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LightningHooksWarning)  # callbacks with nothing to watch
        make_trainer(tmp_path, max_steps=4, log_every_n_steps=2, callbacks=callbacks).fit(model)
    assert "scaled_dot_product_attention" in seen
    assert set(seen) <= set(own), set(seen) - set(own)
    assert len(seen) <= 3 * len(own)  # three forwards of logging steps: steps 0, 1 and 3
    scalars = read_scalars(tmp_path)
    assert any(tag.startswith("stability/attn_logit_max_step/") for tag in scalars)
