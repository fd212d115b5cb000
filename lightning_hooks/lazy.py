"""Names a package loads on first use (PEP 562), so that importing it stays cheap.

The package ``lightning_hooks`` and its core load Lightning, matplotlib and TensorBoard only when
a name that needs them is used. A public name that was renamed stays importable under its old
name, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence

__all__ = ["RENAMED", "lazy_names"]

RENAMED = {
    "GradientAlarm": "TrainingAlarm",
    "GradientAlarms": "TrainingAlarms",
    "GradientAlarmError": "TrainingAlarmError",
    "GradientAlarmWarning": "TrainingAlarmWarning",
}
"""Public names of release 0.2.0 and their names now: the alarms carry the loss, stall and
attention rules too, not only the gradient's."""


def lazy_names(
    package: str,
    where: Mapping[str, str],
    public: Sequence[str],
    renamed: Mapping[str, str] | None = None,
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """Build the module-level ``__getattr__`` and ``__dir__`` for ``package``.

    Args:
        package: the package's ``__name__``.
        where: a public name -> its module, imported on first access; the name is then cached
            in the package's namespace.
        public: the package's ``__all__``.
        renamed: an old name -> its name now, in this package (default: :data:`RENAMED`, the
            names among them that ``public`` holds): the old one warns and gives the new.

    Returns:
        The module's ``__getattr__`` and ``__dir__``. ``__getattr__`` raises ``AttributeError``
        for a name that is neither public nor renamed.
    """
    if renamed is None:
        renamed = {old: new for old, new in RENAMED.items() if new in public}

    def get(name: str) -> object:
        new = renamed.get(name)
        if new is not None:
            warnings.warn(
                f"{package}.{name} is renamed {new} (it carries every alarm rule, not only the "
                f"gradient's); the old name goes in a later release",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(sys.modules[package], new)
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        vars(sys.modules[package])[name] = value
        return value

    def listing() -> list[str]:
        return sorted({*vars(sys.modules[package]), *public})

    return get, listing
