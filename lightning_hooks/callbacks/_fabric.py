"""What a callback reads off a Fabric run: a Trainer's view of ``Fabric``, and its refusals.

Our callbacks read a handful of the Trainer's attributes (its loggers, ``global_step``,
``is_global_zero``, the clipping, the AMP scaler). :class:`FabricTrainer` gives the same names
over a :class:`lightning.fabric.Fabric`, so that one callback body serves both loops;
:func:`check_fabric` refuses what Fabric cannot give, naming why.
"""

from __future__ import annotations

from typing import Any

from lightning_fabric.utilities.exceptions import MisconfigurationException
from torch import nn

__all__ = ["FABRIC_EVERY_N_STEPS", "FabricTrainer", "check_fabric", "original_module"]

FABRIC_EVERY_N_STEPS = 50
"""The cadence under Fabric when the callback's ``every_n_steps`` is ``None``: Fabric has no
``log_every_n_steps``, so the Trainer's default."""

_SUPPORTED_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy")
_REFUSED_STRATEGIES = (
    "FSDPStrategy",
    "DeepSpeedStrategy",
    "ModelParallelStrategy",
    "XLAStrategy",
    "XLAFSDPStrategy",
    "DataParallelStrategy",
)
_TRAINER_ONLY: dict[str, str] = {
    "LayerTimeCallback": "it times on the LightningModule's device (pl_module.device), which a "
    "plain nn.Module set up by Fabric does not have. Under Fabric: GradFlowCallback, "
    "ActivationStatsCallback, DeadReLUCallback, SaturationCallback.",
    "FeatureMapCallback": "it draws its probe images from the training batch, which Fabric does "
    "not hand to callbacks. Under Fabric: GradFlowCallback, ActivationStatsCallback, "
    "DeadReLUCallback, SaturationCallback.",
}
"""Callbacks refused under Fabric, with the reason."""


class _StrategyView:
    """The one attribute of a Trainer's strategy our callbacks read: its precision plugin."""

    def __init__(self, fabric: Any) -> None:
        self.precision_plugin = fabric.strategy.precision


class FabricTrainer:
    """The attributes of a ``pl.Trainer`` that our callbacks read, over a ``Fabric``.

    ``global_step`` counts the optimizer steps of the watched module's optimizers (Fabric has no
    step counter); ``current_epoch`` counts ``fabric.call("on_train_epoch_end")``;
    ``should_stop`` is never read by Fabric (``on_alarm="stop"`` is refused).

    Args:
        fabric: the ``Fabric`` whose loop is watched.
        callback: the one callback written for (the logger saves of ``_writing.py``).

    Example:
        >>> from lightning.fabric import Fabric
        >>> trainer = FabricTrainer(Fabric(accelerator="cpu", devices=1), callback=None)
        >>> trainer.global_step, trainer.log_every_n_steps, trainer.is_global_zero
        (0, 50, True)
    """

    def __init__(self, fabric: Any, callback: Any) -> None:
        self.fabric = fabric
        self.strategy = _StrategyView(fabric)
        self.callbacks = [callback]
        self.global_step = 0
        self.current_epoch = 0
        self.should_stop = False
        self.log_every_n_steps = FABRIC_EVERY_N_STEPS
        self.optimizers: list[Any] = []
        self.gradient_clip_val: float | None = None
        self.gradient_clip_algorithm: str | None = None

    @property
    def loggers(self) -> list[Any]:
        """Fabric's loggers (``Fabric(loggers=[...])``)."""
        return list(self.fabric.loggers)

    @property
    def is_global_zero(self) -> bool:
        """Whether this process is rank 0."""
        return bool(self.fabric.is_global_zero)


def original_module(module: nn.Module) -> nn.Module:
    """The user's module inside Fabric's wrapper (``_FabricModule.module``), else ``module``."""
    inner = getattr(module, "module", None)
    return inner if type(module).__name__ == "_FabricModule" and inner is not None else module


def check_fabric(callback: Any, fabric: Any) -> None:
    """Refuse what a callback cannot do under Fabric, naming why and what works.

    Raises:
        MisconfigurationException: an unsupported strategy, no logger, or a callback that needs
            the Trainer.
        ValueError: ``on_alarm`` asks to ``stop`` (Fabric's loop has no ``should_stop``).
    """
    name = type(callback).__name__
    if name in _TRAINER_ONLY:
        raise MisconfigurationException(f"{name} does not work under Fabric: {_TRAINER_ONLY[name]}")
    strategy = type(fabric.strategy)
    mro = {c.__name__ for c in strategy.__mro__}
    if mro & set(_REFUSED_STRATEGIES) or not mro & set(_SUPPORTED_STRATEGIES):
        raise MisconfigurationException(
            f"{name} under Fabric supports strategy in ('auto' on one device, 'ddp'), got "
            f"{strategy.__name__}: under FSDP, DeepSpeed and model parallelism the parameters are "
            "sharded and their statistics are not made whole there; under DataParallel each "
            "replica sees part of the batch."
        )
    if not fabric.loggers:
        raise MisconfigurationException(
            f"{name} needs a logger, but the Fabric has none. Use "
            "Fabric(loggers=[TensorBoardLogger(...)]) (lightning.fabric.loggers)."
        )
    actions = getattr(getattr(callback, "policy", None), "actions", {})
    if "stop" in actions.values():
        stopping = sorted(rule for rule, action in actions.items() if action == "stop")
        raise ValueError(
            f"{name}(on_alarm=...): 'stop' (for {stopping}) needs a Trainer; a Fabric loop has "
            "no should_stop to set. Under Fabric on_alarm must be in ('warn', 'raise', 'skip', "
            f"'log'), got 'stop'."
        )
