"""Which sink adapts which logger, and the one guarded way to write to every logger."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.logging.sinks.base import LoggerSink

__all__ = ["each_sink", "register_sink", "sinks_for"]

_KINDS: list[type[LoggerSink]] = []
# One sink per logger for the logger's life: a sink that failed stays failed.
_SINKS: weakref.WeakKeyDictionary[Any, LoggerSink] = weakref.WeakKeyDictionary()
_FAILED: weakref.WeakSet[LoggerSink] = weakref.WeakSet()


def register_sink(kind: type[LoggerSink]) -> type[LoggerSink]:
    """Adapt the loggers that ``kind.accepts`` with ``kind``, before every kind registered
    earlier (a subclass's sink is registered after its base's). Usable as a class decorator.

    Example:
        >>> class MySink(LoggerSink):
        ...     @classmethod
        ...     def accepts(cls, logger):
        ...         return type(logger).__name__ == "MyLogger"
        >>> register_sink(MySink) is MySink
        True
        >>> _KINDS.remove(MySink)
    """
    if not (isinstance(kind, type) and issubclass(kind, LoggerSink)):
        raise TypeError(
            f"register_sink(kind={kind!r}): must be a subclass of LoggerSink, got {type(kind)}"
        )
    _KINDS.insert(0, kind)
    return kind


def _builtin() -> None:
    """Register the built-in sinks once (imported here: they import the logging modules)."""
    if _KINDS:
        return
    from lightning_hooks.logging.sinks.csv import CSVSink
    from lightning_hooks.logging.sinks.mlflow import MLflowSink
    from lightning_hooks.logging.sinks.tensorboard import TensorBoardSink
    from lightning_hooks.logging.sinks.wandb import WandbSink

    _KINDS.extend([TensorBoardSink, WandbSink, MLflowSink, CSVSink])


def _sink(logger: Any) -> LoggerSink:
    sink = _SINKS.get(logger)
    if sink is None:
        kind = next((k for k in _KINDS if k.accepts(logger)), LoggerSink)
        sink = _SINKS[logger] = kind(logger)
    return sink


def sinks_for(loggers: Sequence[Any]) -> list[LoggerSink]:
    """One live sink per distinct logger among ``loggers`` (a logger listed twice is written
    once); a sink whose client raised is left out.

    Example:
        >>> from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
        >>> tb, csv = TensorBoardLogger("/tmp/x"), CSVLogger("/tmp/x")
        >>> [type(s).__name__ for s in sinks_for([tb, csv, tb])]
        ['TensorBoardSink', 'CSVSink']
    """
    _builtin()
    sinks: list[LoggerSink] = []
    for logger in loggers:
        sink = _sink(logger)
        if sink not in sinks and sink not in _FAILED:
            sinks.append(sink)
    return sinks


def each_sink(loggers: Sequence[Any], write: Callable[[LoggerSink], None]) -> None:
    """``write`` to each live sink of ``loggers``. A sink whose client raises (a network error,
    a closed run) is left out from then on, with one warning, and training goes on; with
    ``LIGHTNING_HOOKS_STRICT=1`` the error is raised instead."""
    from lightning_hooks.core.hooks.guard import strict_default

    for sink in sinks_for(loggers):
        try:
            write(sink)
        except Exception as err:
            if strict_default():
                raise
            _FAILED.add(sink)
            _warn_failed(sink, err)


def _warn_failed(sink: LoggerSink, err: Exception) -> None:
    from pytorch_lightning.utilities import rank_zero_warn

    rank_zero_warn(
        f"lightning_hooks: {type(sink.logger).__name__} raised {type(err).__name__}: {err}; "
        "nothing more of ours is written to it in this run, training goes on.",
        category=LightningHooksWarning,
    )
