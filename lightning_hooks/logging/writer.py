"""Everything that writes: scalars to every Lightning logger, images to TensorBoard only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure

from lightning_hooks.logging.dashboard import record_tags

__all__ = [
    "log_embedding",
    "log_figure",
    "log_image",
    "log_scalars",
    "log_text",
    "save_loggers",
    "tensorboard_writers",
]


def _tensorboard_logger_types() -> tuple[type, ...]:
    # Both namespaces: a plain isinstance against one silently misses the other's loggers.
    found: list[type] = []
    try:
        from pytorch_lightning.loggers import TensorBoardLogger as PLTensorBoardLogger

        found.append(PLTensorBoardLogger)
    except ImportError:  # pragma: no cover - pytorch_lightning is a dependency
        pass
    try:
        from lightning.pytorch.loggers import TensorBoardLogger as LTensorBoardLogger

        found.append(LTensorBoardLogger)
    except ImportError:
        pass
    return tuple(found)


def tensorboard_writers(loggers: Sequence[Any]) -> list[Any]:
    """The ``SummaryWriter`` of each TensorBoard logger among ``loggers`` (either namespace)."""
    types = _tensorboard_logger_types()
    return [getattr(logger, "experiment") for logger in loggers if isinstance(logger, types)]  # noqa: B009


def log_scalars(loggers: Sequence[Any], metrics: Mapping[str, float], step: int) -> None:
    """Send ``metrics`` to every logger (TensorBoard, CSV, ...); loggers write on rank 0 only.

    A plain ``TensorBoardLogger`` gets them as one event holding every value (what
    :func:`_write_summary` does), not one event per scalar as its ``log_metrics`` writes: the
    same tags, steps and values in the file, one queue hand-off to its writer thread instead of
    one per scalar (a logging step writes a hundred or more).
    """
    if not metrics:
        return
    for logger in loggers:
        if not _write_summary(logger, metrics, step):
            logger.log_metrics(dict(metrics), step=step)
    for writer in tensorboard_writers(loggers):
        record_tags(writer, metrics)


def _write_summary(logger: Any, metrics: Mapping[str, float], step: int) -> bool:
    """``metrics`` as one TensorBoard event, ``simple_value`` per tag as ``add_scalar`` writes
    them; ``False`` (nothing written) unless ``logger`` is a TensorBoardLogger itself (not a
    subclass, which may log otherwise) with no prefix, whose writer is torch's ``SummaryWriter``
    (on ranks other than 0 it is Lightning's dummy: its ``log_metrics`` does nothing there)."""
    prefix: str = getattr(logger, "_prefix", "")
    if type(logger) not in _tensorboard_logger_types() or prefix:
        return False
    from tensorboard.compat.proto.summary_pb2 import Summary
    from torch.utils.tensorboard import SummaryWriter

    writer = logger.experiment
    if not isinstance(writer, SummaryWriter):
        return False
    values = [Summary.Value(tag=tag, simple_value=float(v)) for tag, v in metrics.items()]
    writer._get_file_writer().add_summary(Summary(value=values), step)  # type: ignore[no-untyped-call]
    return True


def save_loggers(loggers: Sequence[Any]) -> None:
    """Save every logger as Lightning does after its own ``log_metrics``: the
    ``TensorBoardLogger`` flushes its event file, so what was written survives a SIGKILL."""
    for logger in loggers:
        logger.save()


def log_figure(loggers: Sequence[Any], tag: str, figure: Figure, step: int) -> None:
    """Write a matplotlib figure as an image to every TensorBoard logger."""
    for writer in tensorboard_writers(loggers):
        writer.add_figure(tag, figure, global_step=step, close=False)


def log_text(loggers: Sequence[Any], tag: str, text: str, step: int) -> None:
    """Write markdown ``text`` to every TensorBoard logger (``SummaryWriter.add_text``)."""
    for writer in tensorboard_writers(loggers):
        writer.add_text(tag, text, global_step=step)


def log_image(loggers: Sequence[Any], tag: str, image: Any, step: int) -> None:
    """Write a ``CHW`` image tensor in ``[0, 1]`` to every TensorBoard logger."""
    for writer in tensorboard_writers(loggers):
        writer.add_image(tag, image, global_step=step, dataformats="CHW")


def log_embedding(
    loggers: Sequence[Any], tag: str, features: Any, labels: list[Any] | None, step: int
) -> None:
    """Write ``[N, D]`` features (and ``N`` labels) to every TensorBoard logger's projector."""
    for writer in tensorboard_writers(loggers):
        writer.add_embedding(features, metadata=labels, global_step=step, tag=tag)
