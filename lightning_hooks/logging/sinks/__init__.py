"""The writer interface (:class:`LoggerSink`) and one adapter per kind of Lightning logger."""

from lightning_hooks.logging.sinks.base import LoggerSink, Moments
from lightning_hooks.logging.sinks.registry import each_sink, register_sink, sinks_for

__all__ = ["LoggerSink", "Moments", "each_sink", "register_sink", "sinks_for"]
