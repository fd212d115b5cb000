"""What ``GradFlowCallback`` does when an alarm fires: the action of each rule.

:func:`check_actions` reads ``on_alarm`` as the action of each rule: warn, stop the fit, raise,
skip the optimizer step, or only log.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Literal

from lightning_hooks.core.alarms import ALARM_RULES
from lightning_hooks.tags import NOTICES

__all__ = ["Action", "check_actions"]

Action = Literal["warn", "stop", "raise", "skip", "log"]
_ACTIONS: tuple[Action, ...] = ("warn", "stop", "raise", "skip", "log")
# The rules an action can apply to. Some notices take none: the GradScaler already acts on
# amp_overflow, and a setback takes a few steps to distinguish from a divergence, which the
# *diverging* rule acts on once confirmed.
_ACTIONABLE = tuple(rule for rule in ALARM_RULES if rule not in NOTICES or NOTICES[rule].acts)
# Skipping an optimizer step does not cure what these rules find.
_NOT_SKIPPABLE = ("vanishing", "loss_spike", "diverging", "stall", "attention")
# Healthy runs also show one-step spikes and stalls (see benchmarks/divergence.py), so unless
# named these are only logged. A spike that harms the optimizer also raises *explosion*, which
# warns.
_NOTICES_LOGGED_BY_DEFAULT = tuple(rule for rule in _ACTIONABLE if rule in NOTICES)


def check_actions(on_alarm: object, owner: str) -> dict[str, Action]:
    """Read ``on_alarm`` as an action per rule.

    | ``on_alarm``            | the alarm rules              | the notices *spike* and *stall* |
    | ----------------------- | ---------------------------- | ------------------------------- |
    | ``"warn"``, ``"stop"``, | that action                  | ``"log"``                       |
    | ``"raise"``             |                              |                                 |
    | ``"log"``               | ``"log"``                    | ``"log"``                       |
    | ``"skip"``              | ``"skip"``, or ``"warn"``    | *spike*: ``"skip"``;            |
    |                         | where a skip cannot cure     | *stall*: ``"warn"``             |
    | a mapping               | as named, else ``"warn"``    | as named, else ``"log"``        |

    So a single ``"stop"`` or ``"raise"`` never ends a run on a notice, which healthy runs show
    too; skipping a spike's step is what ``"skip"`` is for. The rules a skipped step cannot cure
    are *vanishing*, *loss_spike*, *diverging*, *stall* and *attention*.

    Args:
        on_alarm: one action for every rule, or a mapping of rule to action.
        owner: the callback whose argument it is, which its errors name.

    Returns:
        The action of every rule, by rule.

    Raises:
        ValueError: a rule or an action is unknown. The message names the allowed values.
        TypeError: ``on_alarm`` is neither a string nor a mapping.

    Example:
        >>> check_actions("skip", "Cb")["vanishing"], check_actions("warn", "Cb")["spike"]
        ('warn', 'log')
        >>> check_actions("stop", "Cb")["diverging"], check_actions("stop", "Cb")["spike"]
        ('stop', 'log')
        >>> check_actions({"spike": "stop"}, "Cb")["spike"]
        'stop'
    """
    if not isinstance(on_alarm, str | Mapping):
        raise TypeError(
            f"{owner}(on_alarm={on_alarm!r}): must be one of {_ACTIONS} or a mapping "
            f"{{rule: action}} with rules in {_ACTIONABLE}, got {on_alarm!r}"
        )
    if isinstance(on_alarm, str) and on_alarm not in _ACTIONS:
        close = difflib.get_close_matches(on_alarm, _ACTIONS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"{owner}(on_alarm={on_alarm!r}): must be one of {_ACTIONS} or a mapping "
            f"{{rule: action}}, got {on_alarm!r}{hint}"
        )
    given = _one_action_for_all(on_alarm) if isinstance(on_alarm, str) else on_alarm
    # The defaults, which a mapping's rules replace:
    actions: dict[str, Action] = dict.fromkeys(_ACTIONABLE, "warn")
    actions.update(dict.fromkeys(_NOTICES_LOGGED_BY_DEFAULT, "log"))
    for rule, action in given.items():
        if rule not in _ACTIONABLE:
            raise ValueError(
                f"{owner}(on_alarm={on_alarm!r}): rules must be in {_ACTIONABLE}, got {rule!r}"
            )
        skippable = rule not in _NOT_SKIPPABLE
        if action not in _ACTIONS or (action == "skip" and not skippable):
            allowed = _ACTIONS if skippable else tuple(a for a in _ACTIONS if a != "skip")
            raise ValueError(
                f"{owner}(on_alarm={on_alarm!r}): the action for {rule!r} must be in "
                f"{allowed}, got {action!r}"
            )
        actions[rule] = action
    return actions


def _one_action_for_all(action: str) -> dict[str, str]:
    """Return the action of each rule under a single ``on_alarm`` action (see the table above).

    Args:
        action: one of the actions.

    Returns:
        The action of every rule an action applies to, by rule.
    """
    actions = dict.fromkeys(_ACTIONABLE, action)
    if action == "skip":
        actions.update(dict.fromkeys(_NOT_SKIPPABLE, "warn"))
    if action in ("warn", "stop", "raise"):
        actions.update(dict.fromkeys(_NOTICES_LOGGED_BY_DEFAULT, "log"))
    return actions
