"""A layer that no optimizer steps is never dropped silently: one warning names it."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from lightning_hooks import GradFlowCallback, LightningHooksWarning

from conftest import TinyMLP, make_trainer, read_scalars


class FirstLayerOnly(TinyMLP):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net[0].parameters(), lr=0.1)


def test_layers_no_optimizer_steps_are_named_once(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[GradFlowCallback(every_n_steps=1)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(FirstLayerOnly())
    ours = [str(w.message) for w in caught if issubclass(w.category, LightningHooksWarning)]
    assert ours == [
        "GradFlowCallback: no optimizer of the Trainer steps the trainable parameters of "
        "'net.2', 'net.4'; these layers are not measured."
    ]
    layers = {
        t.split("/")[2] for t in read_scalars(tmp_path) if t.startswith("grad_flow/grad_norm/")
    }
    assert layers == {"net.0"}
