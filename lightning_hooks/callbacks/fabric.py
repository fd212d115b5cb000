"""What a callback is in a Fabric loop: :class:`FabricHooks`, the entry points Fabric calls.

Every callback is a :class:`FabricHooks`: Fabric finds a callback's hooks by name, and the ones
it calls (``on_after_setup``, ``on_after_optimizer_step``) and ``release`` are defined here. The
first starts a :class:`~.fabric_run.FabricRun`, which drives the callback's Trainer hooks in the
Trainer's place, and which :mod:`.fabric_run` holds with what it needs. See
``docs/fabric.md``. Lightning's Trainer is handled in :mod:`.trainer`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from lightning_fabric import Fabric
from pytorch_lightning.utilities import rank_zero_warn
from torch import nn

from lightning_hooks.callbacks.fabric_run import FabricDriven, FabricRun, RunHolder
from lightning_hooks.errors import LightningHooksWarning

__all__ = ["FabricHooks"]


class _RunHolder(FabricDriven, RunHolder, Protocol):
    """A :class:`FabricHooks` whose class has the hooks the run drives."""


class FabricHooks:
    """A callback's entry points for Fabric's calls in a Fabric loop, and the run they start.

    Fabric finds a callback's hooks by name (``Fabric.call``, and its optimizer's
    ``on_after_optimizer_step``), so these are methods of the callback itself. The first,
    ``on_after_setup``, starts a :class:`~.fabric_run.FabricRun` that takes the callback's
    place among Fabric's callbacks and drives its Trainer hooks from then on.

    Each callback defines those hooks (:class:`~.fabric_run.FabricDriven`);
    ``tests/test_architecture.py`` checks that every callback defines its own.

    Args:
        fabric_refusal: why the callback's configuration cannot run in a Fabric loop (``None``:
            it can); the run refuses it with this reason at ``fabric.setup``.
    """

    fabric_refusal: str | None
    """Why the callback's configuration cannot run in a Fabric loop (``None``: it can)."""
    fabric_run: FabricRun | None
    """The run that drives the callback in a Fabric loop, from ``fabric.setup`` to its release."""
    _said_unwatched: bool
    """Whether the callback said that Fabric steps an optimizer while no module is watched."""

    def __init__(self, *, fabric_refusal: str | None) -> None:
        super().__init__()
        self.fabric_refusal = fabric_refusal
        self.fabric_run = None
        self._said_unwatched = False

    def on_after_setup(self: _RunHolder, fabric: Fabric, module: nn.Module) -> None:
        """Watch ``module`` under Fabric: a :class:`~.fabric_run.FabricRun` drives the callback.

        Fabric calls this hook after ``fabric.setup``; see :meth:`~.fabric_run.FabricRun.take_over`.

        Args:
            fabric: the Fabric whose callback list the run takes the callback's place in.
            module: the module Fabric set up, which the run hooks.
        """
        self.fabric_run = FabricRun.take_over(self, fabric, module)

    def on_after_optimizer_step(self, strategy: object, optimizer: torch.optim.Optimizer) -> None:
        """Forward Fabric's hook to the run, when the run could not take the callback's place.

        Without a run no module was set up by ``fabric.setup`` (``fabric.setup_module`` calls
        no callback), so nothing is watched: the callback says so once, with the fix.

        Args:
            strategy: Fabric's strategy, passed on unread.
            optimizer: the optimizer that has just stepped.
        """
        run = self.fabric_run
        if run is not None:
            run.on_after_optimizer_step(strategy, optimizer)
        elif not self._said_unwatched:
            self._said_unwatched = True
            rank_zero_warn(
                f"{type(self).__name__}: Fabric stepped an optimizer, but no module was set up "
                "by fabric.setup, so this callback watches nothing in this loop "
                "(fabric.setup_module calls no callback). Set the model up with "
                "fabric.setup(model, optimizer), or model = fabric.setup(model).",
                category=LightningHooksWarning,
            )

    def release(self) -> None:
        """Write what is pending and remove every hook now, under Fabric.

        Under the Trainer the callback's own hooks do this; a Fabric loop calls it at its end.
        """
        run = self.fabric_run
        self.fabric_run = None
        if run is not None:
            run.on_train_end()
