"""Both Lightning namespaces: ``pytorch_lightning`` and ``lightning.pytorch`` (``lightning``).

The callbacks subclass ``pytorch_lightning.Callback``; ``lightning.pytorch.Trainer`` runs them as
they are. What must not differ is the TensorBoard logger check: either namespace's
``TensorBoardLogger`` gets the chart image and the dashboard layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_hooks import GradFlowCallback
from lightning_hooks.callbacks.trainer import lightning_module_of

from conftest import TinyMLP, hooks_left, read_image_tags, read_scalars, trainer_view_members
from tensorboard_server import read_layouts

L = pytest.importorskip("lightning.pytorch")


def _module(namespace: str) -> pl.LightningModule:
    if namespace == "pl":
        return TinyMLP()

    class LightningTinyMLP(L.LightningModule):  # type: ignore[misc, name-defined]
        """The same TinyMLP, as a ``lightning.pytorch`` module (its Trainer requires one)."""

        def __init__(self) -> None:
            super().__init__()
            self.net = TinyMLP().net

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def train_dataloader(self) -> Any:
            return TinyMLP().train_dataloader()

    return LightningTinyMLP()  # type: ignore[no-any-return]


def _fit(root: Path, trainer_ns: str, logger_ns: str) -> dict[str, list[tuple[int, float]]]:
    import pytorch_lightning.loggers as pl_loggers
    from lightning.pytorch import loggers as l_loggers

    loggers = {"pl": pl_loggers, "L": l_loggers}[logger_ns]
    trainer_cls = {"pl": pl.Trainer, "L": L.Trainer}[trainer_ns]
    pl.seed_everything(3, verbose=False)
    model = _module(trainer_ns)
    trainer = trainer_cls(
        max_epochs=1,
        accelerator="cpu",
        logger=loggers.TensorBoardLogger(str(root), name="tb", version=0),
        callbacks=[GradFlowCallback()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model)
    assert hooks_left(model) == []
    return read_scalars(root)


@pytest.mark.parametrize("logger_ns", ["pl", "L"])
@pytest.mark.parametrize("trainer_ns", ["pl", "L"])
def test_either_trainer_with_either_tensorboard_logger(
    tmp_path: Path, trainer_ns: str, logger_ns: str
) -> None:
    reference = _fit(tmp_path / "reference", "pl", "pl")
    got = _fit(tmp_path / "run", trainer_ns, logger_ns)
    ours = {t for t in got if t.startswith("grad_flow/")}
    assert ours == {t for t in reference if t.startswith("grad_flow/")}
    for tag in ours:
        assert got[tag][-1][1] == pytest.approx(reference[tag][-1][1], rel=1e-5, nan_ok=True)
    assert read_image_tags(tmp_path / "run") == ["grad_flow/chart"]
    assert len(read_layouts(tmp_path / "run")) == 2  # at the first logging step, at the epoch end


@pytest.mark.parametrize("trainer_ns", ["pl", "L"])
def test_either_trainer_offers_what_the_callbacks_read(trainer_ns: str) -> None:
    trainer_cls = {"pl": pl.Trainer, "L": L.Trainer}[trainer_ns]
    trainer = trainer_cls(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False
    )
    assert sorted(n for n in trainer_view_members() if not hasattr(trainer, n)) == []
    assert hasattr(trainer.strategy, "precision_plugin")


def test_a_trainer_only_callback_reads_either_namespaces_lightning_module() -> None:
    for namespace in ("pl", "L"):
        module = _module(namespace)
        assert lightning_module_of("LayerTimeCallback", module) is module
    with pytest.raises(TypeError, match=r"LayerTimeCallback runs under .*Trainer only.*got Linear"):
        lightning_module_of("LayerTimeCallback", torch.nn.Linear(2, 2))
