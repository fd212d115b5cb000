"""Argument checks shared by every public class: each error names the owner, the argument, the
allowed values and the value received. Numbers (never ``bool``) come back as ``int``/``float``."""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import numbers
import reprlib
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = [
    "boolean",
    "callable_or_none",
    "choice",
    "fraction_or_none",
    "module",
    "named_arguments",
    "optimizer",
    "positive_int",
    "real",
]

T = TypeVar("T")
C = TypeVar("C", bound=type)


def _fail(owner: str, name: str, value: Any, expected: str, error: type[Exception]) -> Exception:
    return error(f"{owner}({name}={value!r}): must be {expected}, got {value!r}")


def positive_int(owner: str, name: str, value: Any, *, minimum: int = 1) -> int:
    """``value`` as an ``int`` >= ``minimum``, else ``ValueError``/``TypeError``."""
    kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(owner, name, value, kind, TypeError)
    if int(value) < minimum:
        raise _fail(owner, name, value, kind, ValueError)
    return int(value)


def real(
    owner: str,
    name: str,
    value: Any,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a finite ``float`` in ``[low, high]`` (``low_open``, ``high_open``: exclude)."""
    bounds = [f"{'>' if low_open else '>='} {low}"] if low > -math.inf else []
    bounds += [f"{'<' if high_open else '<='} {high}"] if high < math.inf else []
    kind = f"a finite real {' and '.join(bounds)}".rstrip()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(owner, name, value, kind, TypeError)
    number = float(value)
    too_low = number <= low if low_open else number < low
    too_high = number >= high if high_open else number > high
    if not math.isfinite(number) or too_low or too_high:
        raise _fail(owner, name, value, kind, ValueError)
    return number


def fraction_or_none(owner: str, name: str, value: Any) -> float | None:
    """``value`` as a ``float`` in ``[0, 1]``, or ``None`` (a setting that is off)."""
    return None if value is None else real(owner, name, value, low=0.0, high=1.0)


def boolean(owner: str, name: str, value: Any) -> bool:
    """``value`` if it is a ``bool`` (``numpy.bool_`` too), else ``TypeError``."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise _fail(owner, name, value, "True or False", TypeError)


def choice(owner: str, name: str, value: Any, allowed: Sequence[T]) -> T:
    """``value`` if it is one of ``allowed``, else ``ValueError`` listing them."""
    for option in allowed:
        if type(value) is type(option) and value == option:
            return option
    raise _fail(owner, name, value, f"one of {tuple(allowed)!r}", ValueError)


def callable_or_none(owner: str, name: str, value: Any) -> Callable[..., Any] | None:
    """``value`` if it is callable or ``None``, else ``TypeError``."""
    if value is None or callable(value):
        return value  # type: ignore[no-any-return]
    raise _fail(owner, name, value, "a callable or None", TypeError)


def _instance(owner: str, name: str, value: Any, cls: type, expected: str) -> Any:
    if isinstance(value, cls):
        return value
    raise TypeError(
        f"{owner}({name}={reprlib.repr(value)}): must be {expected}, got {type(value).__name__}"
    )


def module(owner: str, name: str, value: Any) -> Any:
    """``value`` if it is a ``torch.nn.Module``, else ``TypeError`` naming the argument."""
    from torch import nn  # here: the checks above serve torch-free callers too

    return _instance(owner, name, value, nn.Module, "a torch.nn.Module")


def optimizer(owner: str, name: str, value: Any) -> Any:
    """``value`` if it is a ``torch.optim.Optimizer``, else ``TypeError`` naming the argument."""
    import torch

    return _instance(owner, name, value, torch.optim.Optimizer, "a torch.optim.Optimizer")


def named_arguments(cls: C) -> C:
    """Class decorator: the constructor refuses a misspelt keyword by name, with the closest
    valid one, before anything runs (Python's own error says only "unexpected keyword
    argument"). The signature ``help()`` and the docs show stays the constructor's own.

    Example:
        >>> @named_arguments
        ... class Knob:
        ...     def __init__(self, *, level: int = 0, scale: int = 1) -> None: ...
        >>> Knob(levle=1)
        Traceback (most recent call last):
        TypeError: Knob(levle=...): unknown argument (did you mean 'level'?); the arguments are ...
    """
    init: Callable[..., None] = vars(cls)["__init__"]  # its own, not an inherited one
    names = _keyword_names(init)

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        for name in kwargs:
            if name not in names:
                raise TypeError(_unknown_argument(type(self).__name__, name, names))
        init(self, *args, **kwargs)

    setattr(cls, "__init__", checked)  # noqa: B010 (mypy refuses assigning to a method)
    return cls


def _keyword_names(init: Callable[..., None]) -> tuple[str, ...]:
    """The names ``init`` takes by keyword, those of a ``**kwargs: Unpack[TypedDict]`` too."""
    names: list[str] = []
    for parameter in list(inspect.signature(init).parameters.values())[1:]:
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
            names.append(parameter.name)
        elif parameter.kind is parameter.VAR_KEYWORD:
            hint = typing.get_type_hints(init, include_extras=True)[parameter.name]
            names.extend(typing.get_type_hints(typing.get_args(hint)[0]))
    return tuple(names)


def _unknown_argument(owner: str, name: str, names: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{owner}({name}=...): unknown argument{hint}; the arguments are {', '.join(names)}"
