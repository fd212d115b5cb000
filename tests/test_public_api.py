"""The public API is pinned: what ``lightning_hooks`` and ``lightning_hooks.core`` export, and
where each name resolves from. A rename, a removal or a move that loses a name fails here."""

from __future__ import annotations

import importlib
import inspect
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_hooks
from lightning_hooks.core import AlarmRules, GradFlowTracker, HookRegistry, select_modules

PUBLIC = {
    "lightning_hooks": [
        "ActivationStatsCallback", "ActivationStatsTracker", "AlarmFeed", "AlarmRules",
        "DeadReLUCallback", "DeadUnitTracker", "FeatureMapCallback", "GradFlowCallback",
        "GradFlowTracker",
        "TrainingAlarm", "TrainingAlarmError", "TrainingAlarmWarning", "TrainingAlarms",
        "HookRegistry", "LayerStat", "LayerTable", "LayerTimeCallback", "LightningHooksError",
        "LightningHooksWarning", "MetricStat", "SaturationCallback", "Selection", "StatsCallback",
        "capture_outputs", "select_modules",
    ],
    "lightning_hooks.core": [
        "ALARM_RULES", "ActivationStatsTracker", "AlarmFeed", "AlarmRules", "DeadUnitTracker",
        "DeadUnits",
        "FEATURE_STATS", "FeatureSummary", "FirstNonFinite", "GRAD_FLOW_STATS", "GRAD_STATS",
        "GradFlowTracker", "TrainingAlarm", "TrainingAlarms", "HookRegistry", "LayerHistogram",
        "LayerHistograms", "LayerStat", "LayerStatsAccumulator", "LayerTable",
        "LayerTimer",
        "LayerTimes", "MetricStat", "ParamLayout", "SATURATING_TYPES", "SaturatedUnits",
        "SaturationTracker",
        "Selection", "StabilityStats", "capture_outputs", "feature_stats", "grad_stats",
        "is_kind", "is_training_forward", "iter_float_tensors", "probe_mode", "saturation_mask",
        "select_modules", "torch_equivalent", "unit_saturation",
    ],
}  # fmt: skip


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_exports_are_pinned_and_resolve(package: str) -> None:
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(PUBLIC[package])
    for name in PUBLIC[package]:
        assert getattr(module, name) is not None, name


def test_the_two_facades_export_one_object_per_shared_name() -> None:
    top, core = (importlib.import_module(p) for p in PUBLIC)
    for name in set(PUBLIC["lightning_hooks"]) & set(PUBLIC["lightning_hooks.core"]):
        assert getattr(top, name) is getattr(core, name), name


@pytest.mark.parametrize(
    "name",
    [
        "ActivationStatsCallback",
        "DeadReLUCallback",
        "FeatureMapCallback",
        "GradFlowCallback",
        "LayerTimeCallback",
        "SaturationCallback",
        "StatsCallback",
    ],
)
def test_a_callback_chain_holds_at_most_three_classes_of_ours(name: str) -> None:
    """Composition over inheritance: a callback derives from at most two classes of ours (the
    base and, for a statistic's callback, ``StatsCallback``); what else it needs it holds."""
    import lightning_hooks.callbacks

    cls = getattr(lightning_hooks.callbacks, name)
    ours = [c.__qualname__ for c in cls.__mro__ if c.__module__.split(".")[0] == "lightning_hooks"]
    assert len(ours) <= 3, ours


CONSTRUCTED = sorted(
    name
    for name in PUBLIC["lightning_hooks"]
    if inspect.isclass(cls := getattr(lightning_hooks, name))
    and not issubclass(cls, Exception)
    and not issubclass(cls, Warning)
)


@pytest.mark.parametrize("name", CONSTRUCTED)
def test_every_public_constructor_names_the_closest_argument_to_a_misspelt_one(name: str) -> None:
    """Each keyword of each public class, misspelt (its last letter doubled), is refused
    before anything runs, with the keyword it was meant to be."""
    cls = getattr(lightning_hooks, name)
    if inspect.isabstract(cls):  # a base to subclass (LayerStat): its constructor, concrete
        stubs = {method: lambda *args: None for method in cls.__abstractmethods__}
        cls = type(name, (cls,), stubs)
    keywords = [
        p.name
        for p in inspect.signature(cls).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and len(p.name) > 3
    ]
    assert keywords, name
    for keyword in keywords:
        typo = keyword + keyword[-1]
        with pytest.raises(TypeError, match=rf"^{name}\({typo}=\.\.\.\): unknown argument") as err:
            cls(**{typo: 1})
        assert f"did you mean {keyword!r}?" in str(err.value), (typo, str(err.value))


def test_a_checked_signature_names_each_keyword() -> None:
    """The check lists the keywords a misspelt one is compared with, so a ``**kwargs`` (whose
    names no signature lists) is refused when the class is made, not at its first call."""
    from lightning_hooks.core.checks import named_arguments

    class Loose:
        def __init__(self, **options: object) -> None: ...

    with pytest.raises(TypeError, match=r"named_arguments\(.*Loose.__init__\): takes \*\*options"):
        named_arguments(Loose)


@pytest.mark.parametrize(
    ("module", "old", "new"),
    [
        ("lightning_hooks", "GradientAlarm", "TrainingAlarm"),
        ("lightning_hooks", "GradientAlarms", "TrainingAlarms"),
        ("lightning_hooks", "GradientAlarmError", "TrainingAlarmError"),
        ("lightning_hooks", "GradientAlarmWarning", "TrainingAlarmWarning"),
        ("lightning_hooks.core", "GradientAlarms", "TrainingAlarms"),
        ("lightning_hooks.errors", "GradientAlarmError", "TrainingAlarmError"),
    ],
)
def test_a_renamed_public_name_still_imports_with_a_deprecation_warning(
    module: str, old: str, new: str
) -> None:
    import importlib

    package = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{old} is renamed {new}"):
        value = getattr(package, old)
    assert value is getattr(package, new)
    assert old not in package.__all__


def _use_tracker_alarms() -> None:
    GradFlowTracker(nn.Linear(2, 2), alarms=AlarmRules()).remove()


def _use_tracker_clip() -> None:
    GradFlowTracker(nn.Linear(2, 2), clip=(1.0, "norm")).remove()


def _use_observe_step() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradFlowTracker(model, [opt]) as tracker:
        model(torch.ones(1, 2)).sum().backward()
        tracker.observe(opt, step=3)


def _use_rules_every_n_steps() -> None:
    AlarmRules(every_n_steps=3)


def _use_renamed_name() -> None:
    getattr(lightning_hooks, "GradientAlarms")  # noqa: B009 (the old name, read as a user reads it)


def _use_registry_sampled() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with HookRegistry(model) as registry:
        registry.forward_hook(model[1], lambda *args: None, gated=True)
        registry.sampled = False
        assert registry.sampled is False
        assert registry.logging_step is False
        assert len(model[1]._forward_hooks) == 0  # the gate closed, as 0.2.0's did


def _use_tracker_sampled() -> None:
    with GradFlowTracker(nn.Linear(2, 2)) as tracker:
        tracker.sampled = False
        assert tracker.sampled is False
        assert tracker.registry.logging_step is False


def _use_select_modules_arguments() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    found = select_modules(model, types=nn.Linear, arguments=("include", "exclude"))
    assert found == select_modules(model, types=nn.Linear)


def _use_callback_uses_images() -> None:
    assert lightning_hooks.GradFlowCallback(chart=False).uses_images is False


def _use_callback_flush() -> None:
    from types import SimpleNamespace

    trainer = SimpleNamespace(loggers=[], is_global_zero=True)
    lightning_hooks.GradFlowCallback().flush(trainer)  # type: ignore[arg-type]


def _use_callback_policy() -> None:
    assert lightning_hooks.GradFlowCallback().policy is None  # between fits: no fit's policy


_RELEASE_0_2_USES = {
    "HookCallback.uses_images": _use_callback_uses_images,
    "HookCallback.flush(trainer)": _use_callback_flush,
    "GradFlowCallback.policy": _use_callback_policy,
    "HookRegistry.sampled": _use_registry_sampled,
    "GradFlowTracker.sampled": _use_tracker_sampled,
    "select_modules(arguments=...)": _use_select_modules_arguments,
    "GradFlowTracker(alarms=...)": _use_tracker_alarms,
    "GradFlowTracker(clip=...)": _use_tracker_clip,
    "GradFlowTracker.observe(step=...)": _use_observe_step,
    "AlarmRules(every_n_steps=...)": _use_rules_every_n_steps,
    "lightning_hooks.GradientAlarms": _use_renamed_name,
}
"""Each use of release 0.2.0's API that changed, as a user's line makes it."""


@pytest.mark.parametrize("use", sorted(_RELEASE_0_2_USES))
def test_release_0_2_uses_still_work_and_warn_at_the_users_line(use: str) -> None:
    """Each use of release 0.2.0's API that changed still works, with a ``DeprecationWarning``
    that names the line that made it, not ours: Python's default filters show a warning only
    where it is attributed to the user's code."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _RELEASE_0_2_USES[use]()
    deprecations = [w for w in record if issubclass(w.category, DeprecationWarning)]
    assert deprecations, use
    assert {Path(w.filename).name for w in deprecations} == {Path(__file__).name}
