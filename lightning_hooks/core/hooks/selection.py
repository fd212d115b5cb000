"""Which modules of a model to instrument, by type and by qualified-name pattern.

Hugging Face and timm activations count as the torch class whose function they compute.
"""

from __future__ import annotations

import difflib
import fnmatch
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from lightning_hooks import internals
from lightning_hooks.core.checks import module as check_module
from lightning_hooks.core.checks import named_arguments

__all__ = [
    "KNOWN_ACTIVATIONS",
    "ModuleFilter",
    "Patterns",
    "Selection",
    "as_patterns",
    "compiled_regions",
    "is_kind",
    "select_modules",
    "torch_equivalent",
]

_HF = ("transformers.activations",)
_TIMM = (
    "timm.layers.activations",
    "timm.layers.activations_me",
    "timm.models.layers.activations",  # timm < 0.9
    "timm.models.layers.activations_me",
)

_HF_CLASSES: dict[str, type[nn.Module]] = {
    **dict.fromkeys(("GELUActivation", "NewGELUActivation", "FastGELUActivation"), nn.GELU),
    **dict.fromkeys(("QuickGELUActivation", "GELUTanh", "PytorchGELUTanh"), nn.GELU),
    **dict.fromkeys(("ClippedGELUActivation", "AccurateGELUActivation"), nn.GELU),
    "SiLUActivation": nn.SiLU,
    "MishActivation": nn.Mish,
    "ReLUSquaredActivation": nn.ReLU,
    "LaplaceActivation": nn.Sigmoid,
    "SqrtSoftplusActivation": nn.Softplus,
}
_TIMM_CLASSES: dict[str, type[nn.Module]] = {
    **dict.fromkeys(("GELU", "GELUTanh", "QuickGELU"), nn.GELU),
    **dict.fromkeys(("Swish", "SwishMe"), nn.SiLU),
    **dict.fromkeys(("Mish", "MishMe", "HardMish", "HardMishMe"), nn.Mish),
    **dict.fromkeys(("HardSwish", "HardSwishMe"), nn.Hardswish),
    **dict.fromkeys(("HardSigmoid", "HardSigmoidMe"), nn.Hardsigmoid),
    "Sigmoid": nn.Sigmoid,
    "Tanh": nn.Tanh,
}

KNOWN_ACTIVATIONS: dict[tuple[str, str], type[nn.Module]] = {
    **{(m, c): t for m in _HF for c, t in _HF_CLASSES.items()},
    **{(m, c): t for m in _TIMM for c, t in _TIMM_CLASSES.items()},
}
"""``(defining module, class name)`` of a third-party activation -> the torch class it computes."""
_SEEN: weakref.WeakKeyDictionary[type, type[nn.Module] | None] = weakref.WeakKeyDictionary()
"""A cache keyed by class: the torch class each module class computes as (its MRO walked once;
a saturation hook asks at every logging step)."""


def _equivalent(cls: type) -> type[nn.Module] | None:
    """Return the torch class a known third-party activation ``cls`` computes as, else ``None``."""
    if cls not in _SEEN:
        keys = ((base.__module__, base.__name__) for base in cls.__mro__)
        _SEEN[cls] = next((KNOWN_ACTIVATIONS[k] for k in keys if k in KNOWN_ACTIVATIONS), None)
    return _SEEN[cls]


def torch_equivalent(module: nn.Module) -> type[nn.Module]:
    """Return the torch class ``module`` computes as.

    Args:
        module: the module whose class is looked up.

    Returns:
        Its own class, or the torch class of a known third-party activation.

    Example:
        >>> torch_equivalent(nn.ReLU()).__name__
        'ReLU'
        >>> NewGELUActivation = type("NewGELUActivation", (nn.Module,), {})
        >>> NewGELUActivation.__module__ = "transformers.activations"
        >>> torch_equivalent(NewGELUActivation()).__name__
        'GELU'
    """
    return _equivalent(type(module)) or type(module)


def is_kind(module: nn.Module, types: type[nn.Module] | tuple[type[nn.Module], ...]) -> bool:
    """Return whether ``module`` is of one of ``types``.

    Args:
        module: the module tested.
        types: one torch module class or a tuple of them.

    Returns:
        ``isinstance(module, types)``, or ``True`` for a known third-party activation of one of
        ``types``.

    Example:
        >>> GELU = type("GELU", (nn.Module,), {"__module__": "timm.layers.activations"})
        >>> is_kind(GELU(), nn.GELU), is_kind(GELU(), (nn.ReLU, nn.SiLU))
        (True, False)
    """
    if isinstance(module, types):
        return True
    found = _equivalent(type(module))
    return found is not None and issubclass(found, types)


Patterns = str | Sequence[str] | None
ModuleTypes = type[nn.Module] | tuple[type[nn.Module], ...] | None
ModuleFilter = Callable[[str, nn.Module], bool]


def as_patterns(patterns: Patterns, argument: str = "include") -> tuple[str, ...]:
    """Read one pattern, a sequence of patterns or ``None`` as a tuple of strings.

    Args:
        patterns: the patterns given.
        argument: the argument named in the error.

    Returns:
        The patterns as a tuple (empty for ``None``).

    Raises:
        TypeError: ``patterns`` is not a string, a sequence of strings or ``None``.
    """
    if patterns is None:
        return ()
    if isinstance(patterns, str):
        return (patterns,)
    expected = f"{argument}: must be a glob pattern (str), a sequence of them, or None, got"
    if not isinstance(patterns, Sequence):
        raise TypeError(f"{expected} {patterns!r}")
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(f"{expected} {p!r} ({type(p).__name__})")
    return tuple(patterns)


def _as_types(owner: str, types: ModuleTypes) -> tuple[type[nn.Module], ...] | None:
    """Read ``types`` as a tuple of ``nn.Module`` subclasses (``None`` stays), else raise."""
    if types is None:
        return None
    items = types if isinstance(types, tuple) else (types,)
    expected = "an nn.Module subclass or a tuple of them"
    for t in items:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(f"{owner}(types={types!r}): must be {expected}, got {t!r}")
    return items


@named_arguments
@dataclass(frozen=True)
class Selection:
    """Which modules of a model a callback watches, validated once by :meth:`of`.

    Errors name ``owner`` and the user's names of ``include`` and ``exclude`` (``arguments``).

    Args:
        owner: the class named in the errors.
        types: keep only modules of these types (``None``: any).
        include: glob patterns on qualified names; when given, keep only modules matching one.
        exclude: glob patterns; drop modules matching any.
        arguments: the user's names of ``include`` and ``exclude``, named in the errors.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> [n for n, _ in Selection.of("Cb", types=nn.Linear).modules(model)]
        ['0', '2']
        >>> picked = Selection.of("Cb", include="9", arguments=("layers", "x"))
        >>> picked.modules(model)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Cb(layers='9') matches no module of the model; closest module names: ...
    """

    owner: str
    types: tuple[type[nn.Module], ...] | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    arguments: tuple[str, str] = ("include", "exclude")

    @classmethod
    def of(
        cls,
        owner: str,
        *,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
        arguments: tuple[str, str] = ("include", "exclude"),
    ) -> Selection:
        """Validate and normalize the arguments.

        Args:
            owner: the class named in the errors.
            types: keep only modules of these types (``None``: any).
            include: glob patterns on qualified names; when given, keep only modules matching
                one.
            exclude: glob patterns; drop modules matching any.
            arguments: the user's names of ``include`` and ``exclude``, named in the errors.

        Returns:
            The selection.

        Raises:
            TypeError: ``types`` holds something not an ``nn.Module`` subclass, or a pattern is
                not a string.
        """
        inc, exc = arguments
        return cls(
            owner,
            _as_types(owner, types),
            as_patterns(include, f"{owner}({inc}={include!r})"),
            as_patterns(exclude, f"{owner}({exc}={exclude!r})"),
            arguments,
        )

    def modules(
        self, model: nn.Module, where: ModuleFilter | None = None
    ) -> list[tuple[str, nn.Module]]:
        """Return the selected ``(name, module)`` pairs of ``model`` (:func:`select_modules`).

        Args:
            model: the model to search.
            where: an extra predicate ``(name, module) -> bool``.

        Returns:
            The selected pairs, in registration order.

        Raises:
            TypeError: ``model`` is not a ``torch.nn.Module``.
            ValueError: a pattern matches no module; the message lists the closest real names.
        """
        check_module(f"{self.owner}: Selection.modules", "model", model)
        named = []
        for n, m in model.named_modules():
            name = internals.compiled_name(n)
            if name and not _is_compiled_wrapper(m):
                named.append((name, m))
        names = [n for n, _ in named]
        include_name, exclude_name = (f"{self.owner}({a}" for a in self.arguments)
        _check_patterns(self.include, names, include_name)
        _check_patterns(self.exclude, names, exclude_name)
        return [
            (name, module)
            for name, module in named
            if (self.types is None or is_kind(module, self.types))
            and (not self.include or _matches(name, self.include))
            and not _matches(name, self.exclude)
            and (where is None or where(name, module))
        ]


def _check_patterns(patterns: tuple[str, ...], names: Sequence[str], argument: str) -> None:
    """Raise ``ValueError`` for a pattern that matches none of ``names``, naming the closest."""
    for pattern in patterns:
        if not any(_matches(name, (pattern,)) for name in names):
            plain = pattern.replace("*", "").replace("?", "").strip(".")
            closest = difflib.get_close_matches(plain, names, n=5, cutoff=0.0)
            close = ", ".join(repr(c) for c in closest) or "(the model has none)"
            close_paren = ")" if "(" in argument else ""
            raise ValueError(
                f"{argument}={pattern!r}{close_paren} matches no module of the model; "
                f"closest module names: {close}"
            )


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    """Return whether ``name`` matches one of the glob ``patterns``."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _is_compiled_wrapper(module: nn.Module) -> bool:
    """Return whether ``module`` is the wrapper ``torch.compile`` puts around a module in place."""
    return internals.compiled_original(module) is not None


def compiled_regions(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Return the submodules of ``model`` compiled in place.

    Args:
        model: the model to search.

    Returns:
        ``(eager_name, wrapper)`` of each submodule compiled in place.
    """
    return [
        (internals.compiled_name(name), module)
        for name, module in model.named_modules()
        if name and _is_compiled_wrapper(module)
    ]


def select_modules(  # noqa: PLR0913 (release 0.2.0's signature, its last keyword deprecated)
    model: nn.Module,
    *,
    types: ModuleTypes = None,
    include: Patterns = None,
    exclude: Patterns = None,
    where: ModuleFilter | None = None,
    arguments: tuple[str, str] | None = None,
) -> list[tuple[str, nn.Module]]:
    """Return the ``(qualified_name, module)`` pairs of ``model`` to instrument.

    In registration order: not the root, a shared module once, a submodule compiled in place
    under its eager names.

    Args:
        model: the model to search.
        types: keep only instances of these types, or third-party activations that compute as
            one (:data:`KNOWN_ACTIVATIONS`).
        include: glob patterns (``fnmatch``, e.g. ``"encoder.*"``) on qualified names; when given,
            keep only modules matching one.
        exclude: glob patterns; drop modules matching any.
        where: an extra predicate ``(name, module) -> bool``.
        arguments: deprecated and unused: release 0.2.0's names of ``include`` and ``exclude``
            in the errors, which now name ``select_modules``.

    Returns:
        The selected pairs.

    Raises:
        TypeError: ``types`` holds something not an ``nn.Module`` subclass.
        ValueError: a pattern matches no module; the message lists the closest real names.

    Warns:
        DeprecationWarning: ``arguments`` is given.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> [name for name, _ in select_modules(model, types=nn.Linear)]
        ['0', '2']
        >>> [name for name, _ in select_modules(model, exclude="2")]
        ['0', '1']
    """
    if arguments is not None:
        warnings.warn(
            "select_modules(arguments=...) is deprecated and has no effect: its errors name "
            "select_modules",
            DeprecationWarning,
            stacklevel=2,
        )
    check_module("select_modules", "model", model)
    selection = Selection.of("select_modules", types=types, include=include, exclude=exclude)
    return selection.modules(model, where)
