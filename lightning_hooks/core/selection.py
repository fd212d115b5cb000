"""Choose which modules of a model to instrument, by type and by qualified-name pattern."""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Sequence

from torch import nn

__all__ = ["ModuleFilter", "Patterns", "as_patterns", "select_modules"]

Patterns = str | Sequence[str] | None
ModuleTypes = type[nn.Module] | tuple[type[nn.Module], ...] | None
ModuleFilter = Callable[[str, nn.Module], bool]


def as_patterns(patterns: Patterns, argument: str = "include") -> tuple[str, ...]:
    """Normalize one pattern or a sequence of patterns to a tuple of strings.

    Example:
        >>> as_patterns("encoder.*")
        ('encoder.*',)
        >>> as_patterns(None)
        ()
    """
    if patterns is None:
        return ()
    if isinstance(patterns, str):
        return (patterns,)
    out = tuple(patterns)
    for p in out:
        if not isinstance(p, str):
            raise TypeError(f"{argument}: expected str patterns, got {p!r} ({type(p).__name__})")
    return out


def _closest(pattern: str, names: Sequence[str], n: int = 5) -> list[str]:
    plain = pattern.replace("*", "").replace("?", "").strip(".")
    return difflib.get_close_matches(plain, names, n=n, cutoff=0.0)


def _check_patterns(patterns: tuple[str, ...], names: Sequence[str], argument: str) -> None:
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            close = ", ".join(repr(c) for c in _closest(pattern, names)) or "(the model has none)"
            raise ValueError(
                f"{argument}={pattern!r} matches no module of the model; "
                f"closest module names: {close}"
            )


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _plain_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _is_compiled_wrapper(module: nn.Module) -> bool:
    return isinstance(getattr(module, "_orig_mod", None), nn.Module)


def select_modules(
    model: nn.Module,
    *,
    types: ModuleTypes = None,
    include: Patterns = None,
    exclude: Patterns = None,
    where: ModuleFilter | None = None,
) -> list[tuple[str, nn.Module]]:
    """Return ``(qualified_name, module)`` pairs of ``model`` to instrument, in registration order.

    The root module itself is never returned. A module reachable under two names (a shared
    module) is returned once, under its first name. A submodule compiled in place
    (``model.net = torch.compile(model.net)``) keeps its eager names: the ``_orig_mod`` segment
    is dropped and the compiled wrapper itself is skipped.

    Args:
        model: the model to search.
        types: keep only modules that are instances of these types.
        include: glob patterns (``fnmatch``, e.g. ``"encoder.*"``) on qualified names; when given,
            keep only modules matching at least one. Each pattern must match some module.
        exclude: glob patterns; drop modules matching any. Each pattern must match some module.
        where: an extra predicate ``(name, module) -> bool``.

    Raises:
        ValueError: a pattern matches no module; the message lists the closest real names.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> [name for name, _ in select_modules(model, types=nn.Linear)]
        ['0', '2']
        >>> [name for name, _ in select_modules(model, exclude="2")]
        ['0', '1']
    """
    inc = as_patterns(include, "include")
    exc = as_patterns(exclude, "exclude")
    named = [
        (_plain_name(n), m)
        for n, m in model.named_modules()
        if _plain_name(n) and not _is_compiled_wrapper(m)
    ]
    names = [n for n, _ in named]
    _check_patterns(inc, names, "include")
    _check_patterns(exc, names, "exclude")
    return [
        (name, module)
        for name, module in named
        if (types is None or isinstance(module, types))
        and (not inc or _matches(name, inc))
        and not _matches(name, exc)
        and (where is None or where(name, module))
    ]
