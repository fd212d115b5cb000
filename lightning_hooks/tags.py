"""Every tag's name, in one place: how a family, a statistic and a layer make a tag, how a
logging step's tag is told from an epoch's, and the few fixed tags. The callbacks write with
these, the alarms count under them, and ``lightning-hooks report`` reads them back.

A scalar tag is ``<family>/<stat>/<layer>`` (one curve per layer), ``<family>/global/<stat>``
(over all layers; ``<stat>_p05`` for a percentile over the layers) or ``<family>/alarms/<rule>``.
A logging step's value has ``_step`` after its statistic's name (Lightning's convention for a
value logged on step), so that it never shares a curve with the epoch's aggregate:

    ``grad_flow/grad_norm/{layer}``          ``grad_flow/grad_norm_step/{layer}``
    ``grad_flow/global/grad_norm_p50``       ``grad_flow/global/grad_norm_step_p50``
    ``grad_flow/alarms/diverging``           ``grad_flow/alarms_step/diverging``
    ``layer_time/step_ms``                   ``layer_time/step_ms_step``

No import of torch or Lightning: the report command reads tags without the training code.
"""

from __future__ import annotations

import functools
import re

__all__ = [
    "ALARM_TEXT",
    "GLOBAL",
    "GRAD_FLOW",
    "PERCENTILE",
    "SPIKE_SCORE",
    "STEP",
    "alarm_tag",
    "epoch_tag",
    "grad_flow_tag",
    "layer_tag",
    "step_tag",
]

STEP = "_step"
"""The suffix of a statistic's name in the tags of one logging step."""
GLOBAL = "global"
"""The place of a layer's name in a tag over all layers."""
GRAD_FLOW = "grad_flow"
"""``GradFlowCallback``'s family."""
ALARM_TEXT = f"{GRAD_FLOW}/alarms"
"""The alarms' text: each logging step's new alarms, each epoch's summary. TensorBoard files a
text under ``<tag>/text_summary``."""
PERCENTILE = re.compile(r"_p\d+$")
"""A percentile over the layers at the end of a statistic's name (``grad_norm_p50``)."""
_STEP_SUFFIX = re.compile(r"_step(_p\d+)?$")
_TAGS = 1 << 16  # tags whose derived names are kept (each logging step writes the same ones)


def layer_tag(family: str, stat: str, layer: str | None = None) -> str:
    """``<family>/<stat>/<layer>``, or ``<family>/global/<stat>`` over all layers (``None``).

    Example:
        >>> layer_tag("activations", "kurtosis", "net.0"), layer_tag("saturation", "layers")
        ('activations/kurtosis/net.0', 'saturation/global/layers')
    """
    return f"{family}/{GLOBAL}/{stat}" if layer is None else f"{family}/{stat}/{layer}"


def grad_flow_tag(stat: str, layer: str | None = None) -> str:
    """A gradient-flow tag: ``grad_flow/<stat>/<layer>``, or ``grad_flow/global/<stat>``.

    Example:
        >>> grad_flow_tag("grad_norm", "encoder.0"), grad_flow_tag("grad_norm_p50")
        ('grad_flow/grad_norm/encoder.0', 'grad_flow/global/grad_norm_p50')
    """
    return layer_tag(GRAD_FLOW, stat, layer)


def alarm_tag(rule: str) -> str:
    """The count of one alarm rule: ``grad_flow/alarms/<rule>``, the name the report and its
    gate (``--fail-on``) use too.

    Example:
        >>> alarm_tag("diverging")
        'grad_flow/alarms/diverging'
    """
    return f"{ALARM_TEXT}/{rule}"


SPIKE_SCORE = alarm_tag("spike_score")
"""The counted alarms per 1,000 optimizer steps of the fit: a rate, not a count."""


@functools.lru_cache(maxsize=_TAGS)
def step_tag(tag: str) -> str:
    """The tag of ``tag``'s value at one logging step: ``_step`` after the statistic's name.

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


def epoch_tag(tag: str) -> str | None:
    """The epoch's tag of a logging step's ``tag`` (:func:`step_tag` undone), ``None`` for a
    tag that is not a logging step's.

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
