"""Every tag's name, in one place.

How a family, a statistic and a layer make a tag, how a logging step's tag is told apart from
an epoch's, and the few fixed tags. The callbacks write with these, the alarms count under them,
and ``lightning-hooks report`` reads them back.

A scalar tag is ``<family>/<stat>/<layer>`` (one curve per layer), ``<family>/global/<stat>``
(over all layers; ``<stat>_p05`` for a percentile over the layers), ``<family>/alarms/<rule>``
(what warned) or ``<family>/notices/<name>`` (what was only noticed: :data:`NOTICES`).
A logging step's value has ``_step`` after its statistic's name (Lightning's convention for a
value logged on step), so that it never shares a curve with the epoch's aggregate:

    ``grad_flow/grad_norm/{layer}``          ``grad_flow/grad_norm_step/{layer}``
    ``grad_flow/global/grad_norm_p50``       ``grad_flow/global/grad_norm_step_p50``
    ``grad_flow/alarms/diverging``           ``grad_flow/alarms_step/diverging``
    ``grad_flow/notices/setback``            ``grad_flow/notices_step/setback``
    ``layer_time/step_ms``                   ``layer_time/step_ms_step``

No import of torch or Lightning: the report command reads tags without the training code.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "ACTIVATIONS",
    "ALARMS",
    "ALARM_STEP_TEXT",
    "ALARM_TEXT",
    "DEAD_RELU",
    "FEATURE_MAP",
    "GLOBAL",
    "GRAD_FLOW",
    "LAYER_TIME",
    "LIBRARY_FAMILIES",
    "NOTICES",
    "NOTICES_0_2_0",
    "NOTICE_COUNTS",
    "PERCENTILE",
    "SATURATION",
    "SPIKE_SCORE",
    "STABILITY",
    "STEP",
    "TAG_CACHE_SIZE",
    "Notice",
    "alarm_tag",
    "epoch_tag",
    "family_tag",
    "grad_flow_tag",
    "layer_metric",
    "layer_tag",
    "notice_tag",
    "percentile_stat",
    "step_tag",
    "step_tags",
]

STEP = "_step"
"""The suffix of a statistic's name in the tags of one logging step."""
GLOBAL = "global"
"""The place of a layer's name in a tag over all layers."""
GRAD_FLOW = "grad_flow"
"""``GradFlowCallback``'s family."""
ALARM_TEXT = f"{GRAD_FLOW}/alarms"
"""The alarms' text of each epoch: its summary. TensorBoard files a text under
``<tag>/text_summary``; a logging step's text is under :data:`ALARM_STEP_TEXT`."""
PERCENTILE = re.compile(r"_p\d+$")
"""A percentile over the layers at the end of a statistic's name (``grad_norm_p50``); see
:func:`percentile_stat`."""
_STEP_SUFFIX = re.compile(r"_step(_p\d+)?$")
TAG_CACHE_SIZE = 1 << 16
"""How many tags a cache of what is derived from a tag keeps: each logging step writes the same
tags, so what a tag gives (its step tag, its chart, its bytes) is derived once."""

ACTIVATIONS = "activations"
"""``ActivationStatsCallback``'s family."""
DEAD_RELU = "dead_relu"
"""``DeadReLUCallback``'s family."""
SATURATION = "saturation"
"""``SaturationCallback``'s family."""
LAYER_TIME = "layer_time"
"""``LayerTimeCallback``'s family."""
STABILITY = "stability"
"""The family of ``GradFlowCallback``'s instability statistics (``stability=True``)."""
FEATURE_MAP = "feature_map"
"""``FeatureMapCallback``'s family."""

LIBRARY_FAMILIES = (
    GRAD_FLOW,
    ACTIVATIONS,
    DEAD_RELU,
    SATURATION,
    LAYER_TIME,
    STABILITY,
    FEATURE_MAP,
)
"""The families of the library's own tags; a tag of any other family is a user's statistic
(:class:`~lightning_hooks.StatsCallback`), a column of its own in ``lightning-hooks report``."""


def family_tag(family: str, name: str, part: str | None = None) -> str:
    """Return a tag of a family's own that is not a layer's statistic.

    Such a tag is a picture's (a chart, a heatmap, a histogram, an image), or a value's of the
    whole step.

    Args:
        family: the family the tag is filed under (``"grad_flow"``).
        name: what the tag holds (``"chart"``).
        part: the layer or statistic it is of, or ``None`` for the whole family.

    Returns:
        ``<family>/<name>``, or ``<family>/<name>/<part>``.

    Example:
        >>> family_tag("grad_flow", "chart"), family_tag("activations", "histogram", "net.0")
        ('grad_flow/chart', 'activations/histogram/net.0')
    """
    return f"{family}/{name}" if part is None else f"{family}/{name}/{part}"


def layer_tag(family: str, stat: str, layer: str | None = None) -> str:
    """Return a layer's statistic's tag, or the tag of a statistic over all layers.

    Args:
        family: the family the tag is filed under (``"activations"``).
        stat: the statistic's name (``"kurtosis"``).
        layer: the layer's qualified name, or ``None`` for a value over all layers.

    Returns:
        ``<family>/<stat>/<layer>``, or ``<family>/global/<stat>`` over all layers (``None``).

    Example:
        >>> layer_tag("activations", "kurtosis", "net.0"), layer_tag("saturation", "layers")
        ('activations/kurtosis/net.0', 'saturation/global/layers')
    """
    return f"{family}/{GLOBAL}/{stat}" if layer is None else f"{family}/{stat}/{layer}"


def grad_flow_tag(stat: str, layer: str | None = None) -> str:
    """Return a gradient-flow tag, of one layer or over all layers.

    Args:
        stat: the statistic's name (``"grad_norm"``).
        layer: the layer's qualified name, or ``None`` for a value over all layers.

    Returns:
        ``grad_flow/<stat>/<layer>``, or ``grad_flow/global/<stat>``.

    Example:
        >>> grad_flow_tag("grad_norm", "encoder.0"), grad_flow_tag("grad_norm_p50")
        ('grad_flow/grad_norm/encoder.0', 'grad_flow/global/grad_norm_p50')
    """
    return layer_tag(GRAD_FLOW, stat, layer)


ALARMS = "alarms"
"""The place of a statistic's name in the tags of the alarms that warned (or stopped, raised,
skipped): ``<family>/alarms/<rule>``. ``lightning-hooks report`` sums them as ``warnings``."""
NOTICE_COUNTS = "notices"
"""The place of a statistic's name in the tags of what was only noticed:
``<family>/notices/<name>``. ``lightning-hooks report`` lists them apart from the warnings."""


def alarm_tag(rule: str, family: str = GRAD_FLOW) -> str:
    """Return the tag of the count of one alarm rule's warnings.

    The report and its gate (``--fail-on``) use the same name.

    Args:
        rule: the alarm rule whose warnings are counted (``"diverging"``).
        family: the family whose alarms they are.

    Returns:
        ``<family>/alarms/<rule>``.

    Example:
        >>> alarm_tag("diverging")
        'grad_flow/alarms/diverging'
    """
    return f"{family}/{ALARMS}/{rule}"


def notice_tag(name: str, family: str = GRAD_FLOW) -> str:
    """Return the tag of the count of one notice.

    Args:
        name: the notice's name (``"setback"``, see :data:`NOTICES`).
        family: the family whose notice it is.

    Returns:
        ``<family>/notices/<name>``.

    Example:
        >>> notice_tag("setback")
        'grad_flow/notices/setback'
    """
    return f"{family}/{NOTICE_COUNTS}/{name}"


def percentile_stat(stat: str, q: int) -> str:
    """Return the name of a percentile over the layers of a statistic.

    Args:
        stat: the statistic's name (``"grad_norm"``).
        q: the percentile, from 0 to 100.

    Returns:
        ``<stat>_p<q>``, ``q`` in two digits at least.

    Example:
        >>> percentile_stat("grad_norm", 5), percentile_stat("grad_norm", 50)
        ('grad_norm_p05', 'grad_norm_p50')
    """
    return f"{stat}_p{q:02d}"


def layer_metric(family: str, stat: str) -> str:
    """Return the name of a per-layer statistic across its layers, as the report names it.

    It is a layer's tag without the layer: the report's columns, its JSON and its gate
    (``--fail-on``) name a statistic this way.

    Args:
        family: the family the statistic is filed under (``"grad_flow"``).
        stat: the statistic's name (``"grad_norm"``).

    Returns:
        ``<family>/<stat>``.

    Example:
        >>> layer_metric("grad_flow", "grad_norm")
        'grad_flow/grad_norm'
    """
    return f"{family}/{stat}"


@dataclass(frozen=True)
class Notice:
    """A fact the library notices and logs, and never warns of.

    Healthy runs show it too, so a warning, or a CI gate that counted it, would cry wolf.

    A notice is counted under its :attr:`tag` at each logging step and epoch end and listed in
    the alarms' text; ``lightning-hooks report`` shows it on its ``notices`` line under its
    :attr:`column`, never among the warnings, and the recommended gate (``--fail-on
    'warnings>0'``) never counts it. An alarm rule given the ``"log"`` action
    (``on_alarm={"diverging": "log"}``) is a notice for that fit, counted under
    ``notice_tag(rule)``.

    Example:
        >>> setback = NOTICES["setback"]
        >>> setback.tag, setback.column, setback.gate, setback.acts
        ('grad_flow/notices/setback', 'setbacks', True, False)
    """

    name: str
    """Its name: its alarm rule's, where it has one."""
    column: str
    """Its name in the report's ``notices`` line, and in a ``--fail-on`` rule."""
    gate: bool
    """Whether a ``--fail-on`` rule may name it (``'setbacks>3'``): ``False`` for a fact every
    healthy run of some kind shows, which no threshold tells from a fault."""
    acts: bool
    """Whether ``on_alarm`` may make it act (``{"spike": "warn"}``): then it warns, counted
    under ``alarm_tag(name)``, and is no notice for that fit."""
    about: str
    """What it says of the run, in one sentence."""

    @property
    def tag(self) -> str:
        """Its count's tag: ``grad_flow/notices/<name>``."""
        return notice_tag(self.name)


NOTICES: dict[str, Notice] = {
    notice.name: notice
    for notice in (
        Notice(
            "spike",
            "spikes",
            gate=True,
            acts=True,
            about="One step's gradient 10x to 25x its running scale: healthy runs show such "
            "steps and recover; one that reaches the optimizer at 300x is an explosion, which "
            "warns.",
        ),
        Notice(
            "stall",
            "stalls",
            gate=True,
            acts=True,
            about="An adaptive optimizer's updates shrank 100x while the loss stopped improving: "
            "a schedule's end looks the same.",
        ),
        Notice(
            "setback",
            "setbacks",
            gate=True,
            acts=False,
            about="The loss's running mean rose over diverging's bar; most setbacks recover, "
            "and one that holds is confirmed as diverging, which warns.",
        ),
        Notice(
            "amp_overflow",
            "amp_overflows",
            gate=False,
            acts=False,
            about="A GradScaler skipped a step whose gradient overflowed: it does so by design "
            "while it finds its scale, in every healthy float16 run.",
        ),
        Notice(
            "no_gradient",
            "no_gradient_layers",
            gate=True,
            acts=False,
            about="A trainable layer got no gradient (none, or exactly 0) for vanish_steps "
            "optimizer steps, once per fit: an unused branch or an idle expert harms nothing; "
            "a network whose first layers died whole is vanishing, which warns.",
        ),
    )
}
"""Every notice, by name: the facts logged and never warned under the default
``on_alarm="warn"``. The alarm policy, the tags, the report and its gate read them here."""

NOTICES_0_2_0: dict[str, str] = {
    "spike": "spike",
    "stall": "stall",
    "transient": "setback",
    "amp_overflow": "amp_overflow",
}
"""The rules 0.2.0 only logged or counted under its default ``on_alarm``, by the name it
counted them under (``grad_flow/alarms/<rule>``: it wrote no notices), and their notice's name
today."""


SPIKE_SCORE = alarm_tag("spike_score")
"""Every counted alarm and notice per 1,000 optimizer steps of the fit: a rate, not a count."""


@functools.lru_cache(maxsize=TAG_CACHE_SIZE)
def step_tag(tag: str) -> str:
    """Return the tag of ``tag``'s value at one logging step.

    Args:
        tag: an epoch's tag (or a fixed tag such as ``layer_time/step_ms``).

    Returns:
        ``tag`` with ``_step`` after the statistic's name (before a percentile's ``_p50``).

    Example:
        >>> step_tag("grad_flow/grad_norm/encoder.0"), step_tag("grad_flow/global/grad_norm_p50")
        ('grad_flow/grad_norm_step/encoder.0', 'grad_flow/global/grad_norm_step_p50')
        >>> step_tag("layer_time/step_ms"), step_tag("grad_flow/alarms/spike")
        ('layer_time/step_ms_step', 'grad_flow/alarms_step/spike')
    """
    parts = tag.split("/")
    at = 2 if len(parts) > 2 and parts[1] == GLOBAL else min(1, len(parts) - 1)
    percentile = PERCENTILE.search(parts[at])
    cut = percentile.start() if percentile else len(parts[at])
    parts[at] = parts[at][:cut] + STEP + parts[at][cut:]
    return "/".join(parts)


def step_tags(values: Mapping[str, float]) -> dict[str, float]:
    """Return ``values`` under their logging step's tags.

    Args:
        values: the values by epoch tag.

    Returns:
        The same values, each under its :func:`step_tag`.

    Example:
        >>> step_tags({"grad_flow/grad_norm/encoder.0": 0.5})
        {'grad_flow/grad_norm_step/encoder.0': 0.5}
    """
    return {step_tag(tag): value for tag, value in values.items()}


ALARM_STEP_TEXT = step_tag(ALARM_TEXT)
"""The alarms' text of each logging step: the alarms read since the last one
(``grad_flow/alarms_step``). It has its own tag because an epoch's last step may be a logging
step, where the epoch's summary (:data:`ALARM_TEXT`) is written too, and TensorBoard shows only
one text per tag and step."""


def epoch_tag(tag: str) -> str | None:
    """Return the epoch's tag of a logging step's ``tag``: :func:`step_tag` undone.

    Args:
        tag: a tag read back from a run, a logging step's or an epoch's.

    Returns:
        The epoch's tag, or ``None`` for a tag that is not a logging step's.

    Example:
        >>> epoch_tag("grad_flow/grad_norm_step/x")
        'grad_flow/grad_norm/x'
        >>> epoch_tag("grad_flow/global/grad_norm_step_p50")
        'grad_flow/global/grad_norm_p50'
        >>> epoch_tag("layer_time/step_ms_step"), epoch_tag("grad_flow/grad_norm/x")
        ('layer_time/step_ms', None)
    """
    parts = tag.split("/")
    at = 2 if len(parts) > 2 and parts[1] == GLOBAL else min(1, len(parts) - 1)
    plain = _STEP_SUFFIX.sub(r"\1", parts[at])
    if plain == parts[at]:
        return None
    parts[at] = plain
    return "/".join(parts)
