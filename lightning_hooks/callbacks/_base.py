"""The base every callback shares, composed of its lifecycle, its writing and its cadence.

=====================  ===========================================================================
``_lifecycle.py``      setup, attach, checkpoints, the guard and the ranks' agreement, release
``_watching.py``       the selection checked against the model (a mixin of the lifecycle)
``_writing.py``        logging steps, epoch ends, the loggers' save, the dashboard
``_cadence.py``        the sampled-step gate and the logging points (the per-batch hooks)
=====================  ===========================================================================
"""

from __future__ import annotations

from lightning_hooks.callbacks._cadence import Cadence
from lightning_hooks.callbacks._checks import check_every_n_steps
from lightning_hooks.callbacks.fabric_run import FabricHooks

__all__ = ["HookCallback", "check_every_n_steps"]


class HookCallback(Cadence, FabricHooks):
    """Base of the library's callbacks: owns when hooks exist, subclasses own what they measure.

    Hooks are registered in ``on_train_start`` (after the sanity check) and removed in
    ``on_train_end``, ``on_exception`` and ``teardown``: Lightning runs neither of the last two
    hooks' siblings after an exception, so each of them removes, idempotently. A second ``fit``
    starts from a clean slate. Subclasses implement :meth:`_attach`, :meth:`_detach` and
    :meth:`_log_epoch`, and extend the per-batch hooks through :meth:`_batch_started` and
    :meth:`_batch_ending`.

    Checkpoints: :meth:`state_dict` holds :meth:`_save_state` (the epoch so far, reduced across
    ranks, on the host); :meth:`load_state_dict` keeps it until the hooks are attached, then
    :meth:`_load_state` hands it to the fresh accumulators (under DDP to rank 0 only, so the next
    reduce counts it once). A state saved for other layers is dropped with one warning.
    FSDP1 and DeepSpeed are refused at setup, and so is tensor parallelism; FSDP2 (Lightning's
    ``ModelParallelStrategy`` with ``fully_shard``) is supported.

    Under Fabric (``Fabric(callbacks=[...])``), :class:`~.fabric_run.FabricHooks` drives the same
    hooks from Fabric's ``on_after_setup`` and ``on_after_optimizer_step``.
    """
