"""The rank agreement every fit holds, driven by hand.

``test_distributed_fault_agreement.py`` drives it across processes through ``Trainer.fit``;
this test pins what one process does.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_hooks.callbacks.ranks import RankAgreement
from lightning_hooks.core.hooks.guard import Guard
from lightning_hooks.errors import LightningHooksWarning


def test_one_process_acts_on_the_flags_at_once() -> None:
    """With one process, a stop request stops the trainer, and a failure disables the callback
    and takes its hooks off, with no collective."""
    removed: list[bool] = []
    guard = Guard("Watcher", strict=False)
    ranks = RankAgreement(guard, remove_hooks=lambda: removed.append(True))
    ranks.start()
    trainer = SimpleNamespace(should_stop=False, is_global_zero=True)
    ranks.request_stop(trainer)
    assert trainer.should_stop  # at once: no other rank to agree with
    assert not ranks.stop_requested
    trainer.should_stop = False
    assert not ranks.apply(trainer, 4, failed=0, stopping=1)
    assert trainer.should_stop
    with pytest.warns(LightningHooksWarning, match="Watcher"):
        assert ranks.apply(trainer, 5, failed=1, stopping=0)
    assert guard.failed is not None
    assert removed == [True]
