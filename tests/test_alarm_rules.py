"""The alarm rules in plain torch: backward order, validation, state, the CUDA host copy."""

from __future__ import annotations

import dataclasses
import math
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from lightning_hooks import (
    AlarmFeed,
    AlarmRules,
    GradFlowCallback,
    GradFlowTracker,
    TrainingAlarms,
)

from conftest import TinyMLP, TwoOptimizers, hooks_left, make_trainer, read_scalars

RENAMED = r"AlarmRules\(every_n_steps=\.\.\.\) is deprecated: use evaluate_every_n_steps="


class HeadFirst(nn.Module):
    """Registers its head before its body: registration order is not the forward order."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 1)
        self.body = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def _nan_target_alarm(output_grad: bool) -> Any:
    torch.manual_seed(0)
    model = HeadFirst()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradFlowTracker(model, [opt], output_grad=output_grad) as tracker:
        feed = AlarmFeed(tracker, AlarmRules())
        for step in range(3):
            opt.zero_grad()
            target = torch.full((4, 1), math.nan if step == 2 else 0.0)
            nn.functional.mse_loss(model(torch.randn(4, 8)), target).backward()
            feed.observe(opt, tracker.observe(opt))
            opt.step()
        return feed.training_alarms.poll()


def _absolute_alarm_steps(rules: AlarmRules) -> list[int]:
    """The optimizer steps of 11 where *absolute* fired under ``rules``, in a plain loop."""
    torch.manual_seed(0)
    model = HeadFirst()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradFlowTracker(model, [opt]) as tracker:
        feed = AlarmFeed(tracker, rules)
        for _ in range(11):
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(4, 8)), torch.ones(4, 1)).backward()
            feed.observe(opt, tracker.observe(opt))
            opt.step()
        return [a.step for a in feed.training_alarms.poll() if a.rule == "absolute"]


def test_the_trackers_alarms_of_release_0_2_still_run_with_a_deprecation_warning() -> None:
    """``GradFlowTracker(alarms=...)``, as release 0.2.0 took it, still feeds its alarms at each
    ``observe``: the same alarms as a feed made by hand, and a ``DeprecationWarning`` that names
    the feed."""
    rules = AlarmRules(evaluate_every_n_steps=3, max_grad_norm=1e-12)
    torch.manual_seed(0)
    model = HeadFirst()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(DeprecationWarning, match=r"alarms=.*deprecated.*AlarmFeed\(tracker"):
        tracker = GradFlowTracker(model, [opt], alarms=rules)
    with tracker:
        for _ in range(11):
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(4, 8)), torch.ones(4, 1)).backward()
            tracker.observe(opt)
            opt.step()
        assert tracker.alarms is not None
        steps = [a.step for a in tracker.alarms.poll() if a.rule == "absolute"]
    assert steps == _absolute_alarm_steps(rules) == [0, 3, 6, 9]


def test_evaluate_every_n_steps_evaluates_the_rules_on_steps_0_n_2n() -> None:
    """``AlarmRules(evaluate_every_n_steps=3)``: a rule that fires on every gradient (*absolute*
    with a tiny bar) fires on optimizer steps 0, 3, 6 and 9 of 11, and on no other."""
    rules = AlarmRules(evaluate_every_n_steps=3, max_grad_norm=1e-12)
    assert _absolute_alarm_steps(rules) == [0, 3, 6, 9]


def test_evaluate_every_n_steps_under_trainer_fit_is_steps_0_n_2n(tmp_path: Path) -> None:
    """The same cadence through ``Trainer.fit``: of 12 optimizer steps, *absolute* is counted
    on 0, 3, 6 and 9 (not a callback's ``every_n_steps``, whose steps would be 2, 5, 8, 11)."""
    rules = AlarmRules(evaluate_every_n_steps=3, max_grad_norm=1e-12, diverge_ratio=None)
    callback = GradFlowCallback(alarms=rules, chart=False, on_alarm="log")
    make_trainer(tmp_path, max_epochs=3, callbacks=[callback]).fit(TinyMLP())  # 4 steps an epoch
    # on_alarm="log": every rule a notice, counted under notices
    counted = read_scalars(tmp_path / "tb" / "version_0")["grad_flow/notices_step/absolute"]
    assert len(counted) == 12  # every step is a logging step: the count of each is written
    assert [step for step, count in counted if count > 0] == [0, 3, 6, 9]


def test_evaluate_every_n_steps_counts_each_optimizers_own_steps(tmp_path: Path) -> None:
    """Two optimizers a batch, ``evaluate_every_n_steps=2``: each optimizer is evaluated on every
    second of its own steps. The second steps on optimizer steps 1, 3, 5 and 7 and is evaluated
    on 3 and 7, so its unused layer, with no gradient on 2 evaluated steps, is the notice
    *no_gradient* in the epoch (one count of the global steps never evaluates the second). The
    epoch is written at Lightning's step of its last batch, 3."""
    rules = AlarmRules(evaluate_every_n_steps=2, vanish_steps=2, diverge_ratio=None)
    callback = GradFlowCallback(alarms=rules, chart=False)
    make_trainer(tmp_path, max_epochs=1, callbacks=[callback]).fit(TwoOptimizers(spare=True))
    counted = read_scalars(tmp_path / "tb" / "version_0")["grad_flow/notices/no_gradient"]
    assert counted == [(3, 1.0)]


def test_every_n_steps_is_still_taken_with_a_deprecation_warning() -> None:
    """The old name: a ``DeprecationWarning``, then rules equal to the new name's, which
    evaluate on the same steps; the old attribute reads the new one, with the same warning."""
    with pytest.warns(DeprecationWarning, match=RENAMED):
        old = AlarmRules(every_n_steps=3, max_grad_norm=1e-12)
    new = AlarmRules(evaluate_every_n_steps=3, max_grad_norm=1e-12)
    assert old == new
    assert repr(old) == repr(new)
    assert "every_n_steps=3" in repr(new)
    with pytest.warns(DeprecationWarning, match=RENAMED):
        assert new.every_n_steps == 3
    assert _absolute_alarm_steps(old) == [0, 3, 6, 9]


def test_every_n_steps_and_its_new_name_together_are_refused() -> None:
    with (
        pytest.warns(DeprecationWarning, match=RENAMED),
        pytest.raises(TypeError, match=r"every_n_steps=\.\.\., evaluate_every_n_steps=\.\.\."),
    ):
        AlarmRules(every_n_steps=3, evaluate_every_n_steps=3)


def test_every_n_steps_under_the_old_name_is_checked_as_the_new_one() -> None:
    with (
        pytest.warns(DeprecationWarning, match=RENAMED),
        pytest.raises(
            ValueError, match=r"AlarmRules\(evaluate_every_n_steps=0\): must be a positive"
        ),
    ):
        AlarmRules(every_n_steps=0)


def test_a_misspelt_argument_is_still_answered_with_the_nearest_name() -> None:
    with pytest.raises(TypeError, match=r"did you mean 'evaluate_every_n_steps'\?"):
        AlarmRules(evaluate_every_n_step=2)


def test_the_renamed_rules_replace_and_pickle_without_a_warning() -> None:
    """``dataclasses.replace`` and a pickle round trip keep the cadence and warn nothing (the
    test session turns warnings into errors); a pickle made under the old field name loads."""
    rules = AlarmRules(evaluate_every_n_steps=4)
    assert dataclasses.replace(rules, window=7).evaluate_every_n_steps == 4
    assert pickle.loads(pickle.dumps(rules)) == rules
    state = dict(vars(rules))
    state["every_n_steps"] = state.pop("evaluate_every_n_steps")
    old = AlarmRules.__new__(AlarmRules)
    old.__setstate__(state)
    assert old == rules


def test_nonfinite_gradient_names_the_first_layer_in_backward_order() -> None:
    (alarm,) = _nan_target_alarm(output_grad=True)
    assert (alarm.rule, alarm.layer, alarm.step, alarm.others) == (
        "nonfinite",
        "head",
        2,
        ("body",),
    )
    assert "first layer in backward order" in alarm.message


def test_without_output_hooks_backward_order_is_reverse_registration_order() -> None:
    (alarm,) = _nan_target_alarm(output_grad=False)
    assert alarm.layer == "body"  # the documented approximation, wrong for this model


def test_absolute_threshold_fires_on_the_global_norm() -> None:
    alarms = TrainingAlarms(["a", "global"], AlarmRules(max_grad_norm=1.0))
    for step, norm in enumerate([0.5, 2.0]):
        stats = torch.zeros(2, 5)
        stats[:, 0] = norm
        alarms.update(stats, torch.arange(2), step=step)
    (alarm,) = alarms.poll()
    assert (alarm.rule, alarm.layer, alarm.step, alarm.value, alarm.reference) == (
        "absolute",
        "global",
        1,
        2.0,
        1.0,
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"spike_factor": 0.5}, ValueError, r"spike_factor=0.5\): must be a finite real > 1.0"),
        ({"spike_factor": "x"}, TypeError, r"spike_factor='x'\): must be a finite real > 1.0"),
        ({"window": 2.5}, TypeError, r"AlarmRules\(window=2.5\): must be a positive int, got 2.5"),
        ({"window": 2}, ValueError, r"AlarmRules\(min_history=3\): must be at most window=2"),
        ({"vanish_fraction": math.inf}, ValueError, r"vanish_fraction=inf\): must be a finite"),
        ({"vanish_fraction": 1.0}, ValueError, r"vanish_fraction=1.0\): .* < 1.0, got 1.0"),
        ({"nonfinite": "yes"}, TypeError, r"nonfinite='yes'\): must be True or False"),
        ({"history": 0}, ValueError, r"history=0\): must be a positive int"),
        ({"attn_min_layers": 0}, ValueError, r"attn_min_layers=0\): must be a positive int, got 0"),
        ({"loss_factor": 1}, ValueError, r"loss_factor=1\): must be a finite real > 1.0"),
        ({"diverge_patience": 0}, ValueError, r"diverge_patience=0\): must be a positive int"),
        ({"diverge_lost": -1.0}, ValueError, r"diverge_lost=-1.0\): .* > 0.0, got -1.0"),
        ({"attn_growth": 1.0}, ValueError, r"attn_growth=1.0\): .* > 1.0, got 1.0"),
        ({"attn_logit_min": 0}, ValueError, r"attn_logit_min=0\): .* > 0.0, got 0"),
    ],
)
def test_rules_are_checked_at_construction(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        AlarmRules(**kwargs)


def test_rules_accept_numpy_numbers_and_store_plain_ones() -> None:
    rules = AlarmRules(window=np.int64(8), spike_factor=np.float32(4.0))
    assert (type(rules.window), rules.window, type(rules.spike_factor)) == (int, 8, float)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"on_alarm": "panic"},
            ValueError,
            r"on_alarm='panic'\): must be one of \('warn', .*'log'\) or a mapping .*got 'panic'$",
        ),
        (
            {"on_alarm": "stopp"},
            ValueError,
            r"on_alarm='stopp'\): must be one of .*got 'stopp' \(did you mean 'stop'\?\)",
        ),
        (
            {"on_alarm": {"spike": "panic"}},
            ValueError,
            r"action for 'spike' must be in .*'skip', 'log'\), got 'panic'",
        ),
        (
            {"on_alarm": {"vanishing": "skip"}},
            ValueError,
            r"for 'vanishing' must be in \('warn', 'stop', 'raise', 'log'\)",
        ),
        (
            {"on_alarm": {"amp_overflow": "stop"}},
            ValueError,
            r"rules must be in .*got 'amp_overflow'",
        ),
        ({"on_alarm": None}, TypeError, r"on_alarm=None\): must be one of \('warn'.* got None"),
        ({"on_alarm": ["warn"]}, TypeError, r"on_alarm=\['warn'\]\): must be one of"),
        ({"alarms": "on"}, TypeError, r"alarms='on'\): expected an AlarmRules or a bool, got str"),
        ({"chart": "yes"}, TypeError, r"GradFlowCallback\(chart='yes'\): must be True or False"),
        ({"max_layers_logged": 0}, ValueError, r"max_layers_logged=0\): must be a positive int"),
    ],
)
def test_callback_checks_alarm_arguments(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        GradFlowCallback(**kwargs)


def test_tracker_checks_its_arguments() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"optimizers=SGD.*must be an iterable of torch.optim"):
        GradFlowTracker(model, opt)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"must be an iterable .*got an item 3"):
        GradFlowTracker(model, [3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"GradFlowTracker\(alarms=True\): must be an AlarmRules"):
        GradFlowTracker(model, [opt], alarms=True)  # type: ignore[arg-type]
    rules_must = r"TrainingAlarms\(rules=True\): must be an AlarmRules"
    with GradFlowTracker(model, [opt]) as tracker, pytest.raises(TypeError, match=rules_must):
        AlarmFeed(tracker, True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"GradFlowTracker\(post_clip=1\): must be True or False"):
        GradFlowTracker(model, [opt], post_clip=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"GradFlowTracker\(clip='nrom'\): must be one of"):
        GradFlowTracker(model, [opt], alarms=AlarmRules(), clip=(1.0, "nrom"))
    with pytest.raises(ValueError, match=r"GradFlowTracker\(clip=0.0\): must be"):
        GradFlowTracker(model, [opt], alarms=AlarmRules(), clip=(0.0, "norm"))
    assert hooks_left(model) == []
    with pytest.warns(DeprecationWarning, match=r"clip=\.\.\.\) is deprecated, and without alarms"):
        GradFlowTracker(model, [opt], clip=(1.0, "norm")).remove()
    with pytest.raises(TypeError, match=r"TrainingAlarms\(rules=True\): must be an AlarmRules"):
        TrainingAlarms(["a"], True)  # type: ignore[arg-type]


def test_state_of_other_layers_is_refused() -> None:
    state = TrainingAlarms(["a", "global"]).state_dict()
    with pytest.raises(ValueError, match=r"saved layers \('a', 'global'\) differ"):
        TrainingAlarms(["a", "b", "global"]).load_state_dict(state)


RELEASE_CHECKPOINT = Path(__file__).parent / "data" / "grad_flow_0.2.0.ckpt"
"""A checkpoint saved by release 0.2.0's ``GradFlowCallback`` (see ``release_checkpoint.py``)."""

ADDED_AFTER_0_2_0 = (
    "dead",
    "loss_recent",
    "loss_echo",
    "loss_per_step",
    "loss_step",
    "loss_group",
    "loss_start",
    "loss_peak",
    "loss_trail",
    "log",
)
"""The entries a state gained after release 0.2.0, before states carried a version."""


def _alarms_that_ran() -> TrainingAlarms:
    """Alarms fed gradient norms with a spike and losses with a rise: no part of their state
    is a new instance's."""
    alarms = TrainingAlarms(["a", "b", "global"], AlarmRules(min_history=3))
    norms = [[1.0, 2.0, 2.2], [1.1, 2.1, 2.4], [0.9, 1.9, 2.1], [1.0, 200.0, 200.0]]
    for step, norm in enumerate(norms):
        alarms.update(torch.tensor(norm), step=step)
        alarms.update_loss(torch.tensor(2.0 - 0.1 * step), step=step)
    alarms.poll(wait=True)
    return alarms


def _same(saved: Any, loaded: Any) -> bool:
    """Whether two states' values are the same, ``nan`` equal to ``nan``."""
    if isinstance(saved, torch.Tensor):
        return torch.equal(saved.isnan(), loaded.isnan()) and torch.equal(
            saved.nan_to_num(), loaded.nan_to_num()
        )
    if isinstance(saved, dict):
        return saved.keys() == loaded.keys() and all(_same(v, loaded[k]) for k, v in saved.items())
    if isinstance(saved, list | tuple):
        return len(saved) == len(loaded) and all(map(_same, saved, loaded))
    if isinstance(saved, float) and math.isnan(saved):
        return isinstance(loaded, float) and math.isnan(loaded)
    return bool(saved == loaded)


def test_a_state_saved_now_carries_its_version() -> None:
    state = _alarms_that_ran().state_dict()
    assert state["version"] == 1
    loaded = TrainingAlarms(["a", "b", "global"], AlarmRules(min_history=3))
    loaded.load_state_dict(state)
    assert _same(state, loaded.state_dict())


def test_a_state_saved_without_a_version_loads_as_before() -> None:
    """The layout saved before states carried a version loads whole; one that lacks the
    entries added after release 0.2.0 starts them as a new instance does. The state handed in
    is left as it was."""
    saved = _alarms_that_ran().state_dict()
    unversioned = {k: v for k, v in saved.items() if k != "version"}
    loaded = TrainingAlarms(["a", "b", "global"], AlarmRules(min_history=3))
    loaded.load_state_dict(unversioned)
    assert "version" not in unversioned
    now = loaded.state_dict()
    assert _same({k: v for k, v in now.items() if k != "version"}, unversioned)
    assert now["log"] != [] and now["loss_trail"] != []  # restored, not a new instance's

    shorter = {k: v for k, v in unversioned.items() if k not in ADDED_AFTER_0_2_0}
    loaded = TrainingAlarms(["a", "b", "global"], AlarmRules(min_history=3))
    loaded.load_state_dict(shorter)
    now = loaded.state_dict()
    fresh = TrainingAlarms(["a", "b", "global"]).state_dict()
    assert all(_same(fresh[k], now[k]) for k in ADDED_AFTER_0_2_0)
    assert all(_same(v, now[k]) for k, v in shorter.items())

    older = {k: v for k, v in unversioned.items() if k != "scale"}
    with pytest.raises(ValueError, match=r"load_state_dict: a state of an older version$"):
        TrainingAlarms(["a", "b", "global"]).load_state_dict(older)


def test_a_state_saved_by_release_0_2_0_loads_into_the_current_format() -> None:
    """The alarms' state in release 0.2.0's checkpoint: its values are restored exactly,
    *diverging*'s ``[mean, deviation, best, first]`` become the loss levels, its
    ``transient`` count becomes ``setback``, and a state saved after it carries the version."""
    checkpoint = torch.load(RELEASE_CHECKPOINT, weights_only=False)
    [saved] = [s["alarms"] for k, s in checkpoint["callbacks"].items() if "GradFlow" in k]
    assert "version" not in saved and "diverging" in saved  # release 0.2.0's format
    alarms = TrainingAlarms(saved["layers"])
    alarms.load_state_dict(saved)
    now = alarms.state_dict()
    assert now["version"] == 1
    kept = ("layers", "scale", "low", "loss_scale", "peak_lr", "ring", "ring_steps")
    assert all(_same(saved[k], now[k]) for k in kept)
    # the stall's values; its flag is set afresh at each logging step before it is read
    assert _same(saved["stall"][1:], now["stall"][1:])
    mean, deviation, best, first = saved["diverging"].tolist()
    assert now["loss_levels"] == {
        "seen": saved["loss_seen"],
        "first": first,
        "mean": mean,
        "level": mean,
        "best": best,
        "jitter": deviation,
        "last": mean,
    }
    counts = {k: v for k, v in saved["counts"].items() if k != "transient"}
    assert now["counts"] == {**counts, "no_gradient": 0, "setback": saved["counts"]["transient"]}
    fresh = TrainingAlarms(saved["layers"]).state_dict()
    assert all(_same(fresh[k], now[k]) for k in (*ADDED_AFTER_0_2_0, "loss_setback"))


def test_a_state_of_a_later_version_is_refused_and_the_alarms_keep_theirs() -> None:
    alarms = _alarms_that_ran()
    before = alarms.state_dict()
    later = {**TrainingAlarms(["a", "b", "global"]).state_dict(), "version": 2}
    reads = (
        r"a state of version 2; this release reads version 1 and states saved without a "
        r"version \(release 0\.2\.0's, and the layout saved after it\)"
    )
    with pytest.raises(ValueError, match=reads):
        alarms.load_state_dict(later)
    assert _same(before, alarms.state_dict())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_verdict_is_read_without_a_sync_at_most_one_step_late() -> None:
    """Updates and polls never sync, the one that finds the alarm included (the rules and the
    ring buffer are on the host); the spike of step 3 is read by step 4's poll
    at the latest."""
    alarms = TrainingAlarms(["a", "global"], AlarmRules(min_history=2, window=4), "cuda")
    found: list[Any] = []
    for step, norm in enumerate([1.0, 1.0, 1.0, 100.0, 1.0]):
        torch.cuda.set_sync_debug_mode("error")
        try:
            stats = torch.zeros(2, 5, device="cuda")
            stats[:, 0] = norm
            alarms.update(stats, [0, 1], step=step)  # the rows on the host
            found += alarms.poll()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert step >= 3 or found == []
    assert [(a.rule, a.step) for a in found] == [("spike", 3)]


def test_two_optimizers_on_different_scales_raise_no_global_spike() -> None:
    """A GAN-like alternation: each optimizer's global norm differs by 100x from the other's."""
    alarms = TrainingAlarms(["g", "d", "global"], AlarmRules(min_history=2, window=8))
    for step in range(20):
        row, norm = (0, 0.1) if step % 2 else (1, 10.0)
        stats = torch.full((2, 5), norm)
        stats[:, 3] = 0.0
        alarms.update(stats, torch.tensor([row, 2]), step=step)
    assert alarms.poll() == []
    stats = torch.full((2, 5), 10.0)
    stats[:, 3] = 0.0
    alarms.update(stats, torch.tensor([0, 2]), step=20)  # the generator's layer: 100x its median
    assert [(a.rule, a.layer, a.others) for a in alarms.poll()] == [("spike", "g", ())]


def test_rows_given_as_the_same_tensor_are_read_to_the_host_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A caller passing one rows tensor every step pays its host read once (on CUDA, a sync)."""
    reads: list[int] = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or tolist(t))
    alarms = TrainingAlarms(["g", "d", "global"], AlarmRules())
    rows = torch.tensor([0, 2])
    for step in range(4):
        alarms.update(torch.tensor([1.0, 1.0]), rows, step=step)
    alarms.update(torch.tensor([1.0, 1.0]), torch.tensor([1, 2]), step=4)
    assert len(reads) == 2
    assert alarms.poll() == []


def test_a_misspelt_rule_argument_is_named_with_the_closest_real_one() -> None:
    with pytest.raises(
        TypeError,
        match=r"AlarmRules\(spike_facter=...\): unknown argument \(did you mean 'spike_factor'\?\)",
    ):
        AlarmRules(spike_facter=20)  # type: ignore[call-arg]
    with pytest.raises(
        TypeError,
        match=r"AlarmRules\(zzz=...\): unknown argument; the arguments are spike_factor, ",
    ):
        AlarmRules(zzz=1)  # type: ignore[call-arg]
    assert AlarmRules(spike_factor=20.0) == AlarmRules(20.0)  # positional and named alike
