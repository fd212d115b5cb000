"""The library's warning and exception types."""

from __future__ import annotations

from typing import Protocol

from typing_extensions import NotRequired, TypedDict, Unpack

from lightning_hooks.lazy import lazy_names

__all__ = [
    "Alarm",
    "AlarmFacts",
    "LightningHooksError",
    "LightningHooksWarning",
    "TrainingAlarmError",
    "TrainingAlarmWarning",
]


class Alarm(Protocol):
    """What a warning or an error says of its alarm.

    The alarm is a :class:`~lightning_hooks.core.TrainingAlarm`, declared here by its fields, so
    that this module, which every other imports, imports none of them.
    """

    @property
    def rule(self) -> str:
        """The rule that fired."""
        ...

    @property
    def layer(self) -> str:
        """The layer the alarm names."""
        ...

    @property
    def step(self) -> int:
        """The optimizer step whose gradients fired the alarm."""
        ...

    @property
    def value(self) -> float:
        """The gradient norm (or loss) that fired the alarm."""
        ...

    @property
    def message(self) -> str:
        """The alarm's whole text: a first line read at a glance, then the details."""
        ...


class LightningHooksWarning(UserWarning):
    """Every warning the library emits: filter them with this one category.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("ignore", LightningHooksWarning)
        ...     warnings.warn("GradFlowCallback: ...", TrainingAlarmWarning)
        >>> caught  # an alarm's warning is a LightningHooksWarning too
        []
    """


class LightningHooksError(RuntimeError):
    """Raised by the library when training must not go on.

    Example:
        >>> issubclass(TrainingAlarmError, LightningHooksError)  # on_alarm="raise"
        True
    """


class TrainingAlarmWarning(LightningHooksWarning):
    """A gradient alarm (spike, vanishing, non-finite, ...): the message names rule, layer, step.

    Attributes:
        alarm: the :class:`~lightning_hooks.core.TrainingAlarm` (values, recent norms), or ``None``.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warnings.warn(TrainingAlarmWarning("GradFlowCallback [nonfinite]: ..."))
        >>> caught[0].category.__name__, caught[0].message.alarm is None
        ('TrainingAlarmWarning', True)
    """

    alarm: Alarm | None = None


class AlarmFacts(TypedDict):
    """The facts of an alarm a :class:`TrainingAlarmError` carries, passed by keyword."""

    rule: str  # the rule that fired
    layer: str  # the layer it names
    step: int  # the optimizer step whose gradients fired it
    value: float  # the gradient norm (or loss) that fired it
    alarm: NotRequired[Alarm | None]  # the alarm itself (default None)


def _check_facts(facts: AlarmFacts) -> None:
    """Refuse a misspelt or missing fact by name, as a signature would.

    Args:
        facts: the keyword arguments given to :class:`TrainingAlarmError` besides its message.

    Raises:
        TypeError: a fact is not one of :class:`AlarmFacts`, or one that is required is missing.
    """
    names = tuple(AlarmFacts.__annotations__)
    for name in facts:
        if name not in names:
            raise TypeError(
                f"TrainingAlarmError({name}=...): unknown argument; the arguments are message, "
                f"{', '.join(names)}"
            )
    for name in names[:-1]:
        if name not in facts:
            raise TypeError(f"TrainingAlarmError({name}=...): missing")


class TrainingAlarmError(LightningHooksError):
    """A gradient alarm with ``on_alarm="raise"``: carries the facts of the alarm.

    Args:
        message: what the error says.
        **facts: ``rule``, ``layer``, ``step``, ``value`` and optionally ``alarm``
            (:class:`AlarmFacts`), kept as the attributes below.

    Attributes:
        rule: the rule that fired (``"explosion"``, ``"nonfinite"``, ``"diverging"``, ...).
        layer: the layer it names (``"global"`` for all layers together).
        step: the optimizer step whose gradients fired it.
        value: the gradient norm (or loss) that fired it.
        alarm: the :class:`~lightning_hooks.core.TrainingAlarm`, or ``None``.

    Raises:
        TypeError: a fact is misspelt, or one of ``rule``, ``layer``, ``step`` and ``value`` is
            missing.

    Example:
        >>> error = TrainingAlarmError("nonfinite at step 3", rule="nonfinite", layer="net.0",
        ...                            step=3, value=float("nan"))
        >>> error.rule, error.layer, error.step
        ('nonfinite', 'net.0', 3)
    """

    def __init__(self, message: str, **facts: Unpack[AlarmFacts]) -> None:
        _check_facts(facts)
        super().__init__(message)
        self.rule = facts["rule"]
        self.layer = facts["layer"]
        self.step = facts["step"]
        self.value = facts["value"]
        self.alarm = facts.get("alarm")


__getattr__, __dir__ = lazy_names(__name__, {}, __all__)
"""Release 0.2.0's names of the alarms' error and warning, with a ``DeprecationWarning``."""
