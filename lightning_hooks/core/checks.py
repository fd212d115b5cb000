"""Argument checks shared by every public class.

Each error names the owner, the argument, the allowed values and the value received. Numbers
(never ``bool``) come back as ``int``/``float``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import numbers
import reprlib
import typing
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict, TypeVar

from typing_extensions import Unpack

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "Bounds",
    "boolean",
    "callable_or_none",
    "choice",
    "fraction_or_none",
    "module",
    "named_arguments",
    "optimizer",
    "positive_int",
    "positive_int_or_none",
    "real",
]

T = TypeVar("T")
W = TypeVar("W", bound=Callable[..., object])


def _fail(owner: str, name: str, value: object, expected: str, error: type[Exception]) -> Exception:
    """Build the ``error`` naming ``owner``, the argument ``name``, ``expected`` and ``value``."""
    return error(f"{owner}({name}={value!r}): must be {expected}, got {value!r}")


def positive_int(owner: str, name: str, value: object, *, minimum: int = 1) -> int:
    """Read ``value`` as an ``int`` >= ``minimum``.

    Args:
        owner: the class named in the error.
        name: the argument named in the error.
        value: the value given.
        minimum: the smallest value accepted.

    Returns:
        ``value`` as an ``int``.

    Raises:
        TypeError: ``value`` is not an integer (a ``bool`` is not one).
        ValueError: ``value`` is an integer below ``minimum``.
    """
    kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(owner, name, value, kind, TypeError)
    if int(value) < minimum:
        raise _fail(owner, name, value, kind, ValueError)
    return int(value)


def positive_int_or_none(owner: str, name: str, value: object, *, none_means: str) -> int | None:
    """Read ``value`` as a positive int, or ``None``.

    Args:
        owner: the class named in the error.
        name: the argument named in the error.
        value: the value given.
        none_means: what ``None`` stands for, as the error says it.

    Returns:
        ``value`` as an ``int``, or ``None``.

    Raises:
        ValueError: ``value`` is neither a positive int nor ``None`` (one error type for every
            wrong value).

    Example:
        >>> positive_int_or_none("Cb", "every_n_steps", 10, none_means="the Trainer's")
        10
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(
            f"{owner}({name}={value!r}): must be a positive int or None ({none_means}), "
            f"got {value!r}"
        )
    return int(value)


class Bounds(TypedDict, total=False):
    """The keywords of :func:`real`: an interval's ends and whether each is left out."""

    low: float
    high: float
    low_open: bool
    high_open: bool


class _Interval(NamedTuple):
    """The interval :func:`real` accepts (the whole real line unless bounded)."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def describe(self) -> str:
        """Describe the expected value an error names, e.g. ``"a finite real > 0.0 and <= 1.0"``.

        Returns:
            The description, in the words of an error message.
        """
        bounds = [f"{'>' if self.low_open else '>='} {self.low}"] if self.low > -math.inf else []
        bounds += [f"{'<' if self.high_open else '<='} {self.high}"] if self.high < math.inf else []
        return f"a finite real {' and '.join(bounds)}".rstrip()

    def holds(self, number: float) -> bool:
        """Return whether ``number`` is finite and inside the interval.

        Args:
            number: the value to test against the interval's ends.

        Returns:
            ``True`` if ``number`` is finite and inside the interval.
        """
        too_low = number <= self.low if self.low_open else number < self.low
        too_high = number >= self.high if self.high_open else number > self.high
        return math.isfinite(number) and not too_low and not too_high


def real(owner: str, name: str, value: object, **bounds: Unpack[Bounds]) -> float:
    """Read ``value`` as a finite ``float`` in ``[low, high]``.

    Args:
        owner: the class named in the error.
        name: the argument named in the error.
        value: the value given.
        **bounds: the interval's ends, ``low`` and ``high`` (unbounded where left out), and
            ``low_open``/``high_open`` to exclude an end.

    Returns:
        ``value`` as a ``float``.

    Raises:
        TypeError: ``value`` is not a real number (a ``bool`` is not one).
        ValueError: ``value`` is not finite or lies outside the interval.
    """
    interval = _Interval(**bounds)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(owner, name, value, interval.describe(), TypeError)
    number = float(value)
    if not interval.holds(number):
        raise _fail(owner, name, value, interval.describe(), ValueError)
    return number


def fraction_or_none(owner: str, name: str, value: object) -> float | None:
    """Read ``value`` as a ``float`` in ``[0, 1]``, or ``None`` (a setting that is off).

    Args:
        owner: the class named in the error.
        name: the argument named in the error.
        value: the value given.

    Returns:
        ``value`` as a ``float``, or ``None``.

    Raises:
        TypeError: ``value`` is neither a real number nor ``None``.
        ValueError: ``value`` is outside ``[0, 1]`` or not finite.
    """
    return None if value is None else real(owner, name, value, low=0.0, high=1.0)


def boolean(owner: str, name: str, value: object) -> bool:
    """Read ``value`` as a ``bool`` (a ``numpy.bool_`` too).

    Args:
        owner: the class named in the error.
        name: the argument named in the error.
        value: the value given.

    Returns:
        ``value`` as a ``bool``.

    Raises:
        TypeError: ``value`` is not a ``bool``.
    """
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise _fail(owner, name, value, "True or False", TypeError)


def choice(owner: str, name: str, value: object, allowed: Sequence[T]) -> T:
    """Return ``value`` if it is one of ``allowed``.

    Args:
        owner: the class named in the error.
        name: the argument named in the error.
        value: the value given.
        allowed: the values accepted, listed by the error.

    Returns:
        The option of ``allowed`` that equals ``value`` (and is of its type).

    Raises:
        ValueError: ``value`` is not one of ``allowed``; the error lists them (and names the
            closest, for a string).

    Example:
        >>> try:
        ...     choice("AlarmRules", "quiet_read", "groupd", ("grouped", "triton"))
        ... except ValueError as err:
        ...     print(str(err).split(": ")[1])
        must be one of ('grouped', 'triton'), got 'groupd' (did you mean 'grouped'?)
    """
    for option in allowed:
        if type(value) is type(option) and value == option:
            return option
    names = [option for option in allowed if isinstance(option, str)]
    hint = _did_you_mean(value, names) if isinstance(value, str) else ""
    raise ValueError(
        f"{owner}({name}={value!r}): must be one of {tuple(allowed)!r}, got {value!r}{hint}"
    )


def module_types(owner: str, types: object, bases: tuple[type, ...]) -> None:
    """Refuse ``types`` unless each is a subclass of one of ``bases``, naming them.

    Args:
        owner: the class named in the error.
        types: one class, a tuple of them, or ``None``.
        bases: the classes each type must derive from.

    Raises:
        TypeError: a type is not a subclass of one of ``bases``.

    Example:
        >>> module_types("GradFlowCallback", int, (object,))
        >>> module_types("Owner", "Linear", (type,))
        Traceback (most recent call last):
        TypeError: Owner(types='Linear'): must be a subclass of one of ['type'], got 'Linear'
    """
    for t in types if isinstance(types, tuple) else (types,):
        if t is not None and not (isinstance(t, type) and issubclass(t, bases)):
            raise TypeError(
                f"{owner}(types={types!r}): must be a subclass of one of "
                f"{[b.__name__ for b in bases]}, got {t!r}"
            )


def callable_or_none(owner: str, name: str, value: object) -> Callable[..., Any] | None:
    """Return ``value`` if it is callable or ``None``.

    Args:
        owner: the class named in the error.
        name: the argument named in the error.
        value: the value given.

    Returns:
        ``value``, unchanged.

    Raises:
        TypeError: ``value`` is neither callable nor ``None``.
    """
    if value is None or callable(value):
        return value
    raise _fail(owner, name, value, "a callable or None", TypeError)


def _instance(owner: str, name: str, value: object, cls: type[T], expected: str) -> T:
    """Return ``value`` if it is a ``cls``, else raise a ``TypeError`` that names ``expected``."""
    if isinstance(value, cls):
        return value
    raise TypeError(
        f"{owner}({name}={reprlib.repr(value)}): must be {expected}, got {type(value).__name__}"
    )


def module(owner: str, name: str, value: object) -> nn.Module:
    """Return ``value`` if it is a ``torch.nn.Module``.

    Args:
        owner: the class named in the error.
        name: the argument named in the error.
        value: the value given.

    Returns:
        ``value``, unchanged.

    Raises:
        TypeError: ``value`` is not a ``torch.nn.Module``; the error names the argument.
    """
    from torch import nn  # here: the checks above serve torch-free callers too

    return _instance(owner, name, value, nn.Module, "a torch.nn.Module")


def optimizer(owner: str, name: str, value: object) -> torch.optim.Optimizer:
    """Return ``value`` if it is a ``torch.optim.Optimizer``.

    Args:
        owner: the class named in the error.
        name: the argument named in the error.
        value: the value given.

    Returns:
        ``value``, unchanged.

    Raises:
        TypeError: ``value`` is not a ``torch.optim.Optimizer``; the error names the argument.
    """
    from torch.optim import Optimizer

    return _instance(owner, name, value, Optimizer, "a torch.optim.Optimizer")


def named_arguments(target: W) -> W:
    """Make a constructor or a method refuse a misspelt keyword by name, with the closest one.

    A decorator, of a class (its own ``__init__`` is wrapped) or of a method. The check runs
    before anything else in the call (Python's own error says only "unexpected keyword
    argument"). The signature ``help()`` and the docs show stays the wrapped function's own.

    Args:
        target: the class whose own ``__init__`` is wrapped, or the method wrapped.

    Returns:
        ``target``, its constructor wrapped (a class) or wrapped itself (a method); the wrapper
        raises ``TypeError`` for an unknown keyword.

    Raises:
        TypeError: the wrapped function takes ``**kwargs``, whose names it cannot list.

    Example:
        >>> @named_arguments
        ... class Knob:
        ...     def __init__(self, *, level: int = 0, scale: int = 1) -> None: ...
        ...     @named_arguments
        ...     def turn(self, *, by: int, wrap: bool = False) -> None: ...
        >>> Knob(levle=1)
        Traceback (most recent call last):
        TypeError: Knob(levle=...): unknown argument (did you mean 'level'?); the arguments are ...
        >>> Knob().turn(by=1, warp=True)
        Traceback (most recent call last):
        TypeError: Knob.turn(warp=...): unknown argument (did you mean 'wrap'?); the arguments ...
    """
    if isinstance(target, type):
        init: Callable[..., object] = vars(target)["__init__"]  # its own, not an inherited one
        checked_init = _checked(init, method=None)
        setattr(target, "__init__", checked_init)  # noqa: B010 (mypy refuses assigning to a method)
        return target
    return typing.cast(W, _checked(target, method=target.__name__))


def _checked(function: Callable[..., object], method: str | None) -> Callable[..., object]:
    """Return ``function`` (a constructor, or the method named ``method``) checking keywords."""
    names = _keyword_names(function)

    @functools.wraps(function)
    def checked(self: object, *args: object, **kwargs: object) -> object:
        for name in kwargs:
            if name not in names:
                owner = type(self).__name__
                if method is not None:
                    owner = f"{owner}.{method}"
                raise TypeError(_unknown_argument(owner, name, names))
        return function(self, *args, **kwargs)

    return checked


def _keyword_names(function: Callable[..., object]) -> tuple[str, ...]:
    """Return the names ``function`` takes by keyword, its first (``self``) left out."""
    names: list[str] = []
    for parameter in list(inspect.signature(function).parameters.values())[1:]:
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
            names.append(parameter.name)
        elif parameter.kind is parameter.VAR_KEYWORD:
            raise TypeError(
                f"named_arguments({function.__qualname__}): takes **{parameter.name}, whose "
                "names it cannot list; give each keyword its own parameter"
            )
    return tuple(names)


def _unknown_argument(owner: str, name: str, names: Sequence[str]) -> str:
    """Return the message for an unknown keyword ``name``: the closest and all valid ``names``."""
    hint = _did_you_mean(name, names)
    return f"{owner}({name}=...): unknown argument{hint}; the arguments are {', '.join(names)}"


def _did_you_mean(given: str, names: Sequence[str]) -> str:
    """Return `` (did you mean 'name'?)`` naming the closest to ``given``, or ``""`` if none is."""
    close = difflib.get_close_matches(given, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
