"""``docs/concepts.md`` names every tag a run writes, and a run writes every tag it names.

One fit turns every option on (every callback, the heatmap, the histograms, a projector,
clipping, more layers than ``max_layers_logged``, attention and an output layer, and a layer
that gets no gradient, whose notice a logging step's alarm text names), then the tags
of its event files (and its projector) are compared with the tags the page's "Tags" section
names, both ways.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import (
    ActivationStatsCallback,
    AlarmRules,
    DeadReLUCallback,
    FeatureMapCallback,
    GradFlowCallback,
    LayerTimeCallback,
    SaturationCallback,
)
from lightning_hooks.tags import epoch_tag, step_tag

from conftest import _accumulators

CONCEPTS = Path(__file__).resolve().parents[1] / "docs" / "concepts.md"
LAYOUT = "custom_scalars__config__"
"""TensorBoard's custom-scalars layout: a layout, not a tag (the page says so)."""


class Everything(pl.LightningModule):
    """A convolution with a ReLU, an attention module, a tanh, an output layer, and a spare layer
    that forward never runs (it gets no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU())
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.squash = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)
        self.spare = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.conv(x).reshape(x.shape[0], -1, 16)
        mixed, _ = self.attn(tokens, tokens, tokens)
        return self.head(self.squash(mixed)).mean(1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def documented_tags() -> set[str]:
    """The tags named in backticks under the page's "What is written when", each set ``{a, b}``
    expanded; ``{layer}`` stays a placeholder."""
    text = CONCEPTS.read_text()
    section = text[text.index("### What is written when") : text.index("## Cadence")]
    tags: set[str] = set()
    for span in re.findall(r"`([^`]+)`", section):
        if "/" not in span or not re.fullmatch(r"[a-z0-9_/{}, ]+", span):
            continue  # prose, or a scheme such as `<family>/<stat>/<layer>`
        parts = re.split(r"(\{[^{}]*,[^{}]*\})", span)
        choices = [
            [name.strip() for name in part[1:-1].split(",")] if part.startswith("{") else [part]
            for part in parts
        ]
        tags.update("".join(names) for names in itertools.product(*choices))
    return tags


def logged_tags(log_dir: Path, layers: set[str]) -> set[str]:
    """Every tag of the run's event files and projector, a layer's name (or a layer's name and
    the index of a tensor in its tuple output) made ``{layer}``."""
    tags: set[str] = set()
    for accumulator in _accumulators(log_dir):
        for kind in ("scalars", "images", "histograms", "tensors"):
            tags.update(accumulator.Tags()[kind])
    projector = (log_dir / "projector_config.pbtxt").read_text()
    tags.update(re.findall(r'tensor_name: "([^":]+):', projector))
    tags.discard(LAYOUT)
    return {_placeholder(tag, layers) for tag in tags}


def _placeholder(tag: str, layers: set[str]) -> str:
    head, _, last = tag.rpartition("/")
    if last in layers or last.rpartition(".")[0] in layers:
        return f"{head}/{{layer}}"
    return tag


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str]]:
    """One fit of :class:`Everything` with every callback and option on."""
    pl.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 1, 8, 8, generator=generator)
    y = torch.randint(0, 3, (32,), generator=generator)
    model = Everything()
    callbacks = [
        GradFlowCallback(
            heatmap=True,
            histograms=True,
            max_layers_logged=2,
            alarms=AlarmRules(vanish_steps=3),  # the spare layer's notice in an epoch of 4 steps
        ),
        ActivationStatsCallback(histograms=True),
        DeadReLUCallback(),
        SaturationCallback(),
        LayerTimeCallback(),
        FeatureMapCallback(probe=x[:4], probe_labels=y[:4], embedding="conv.1"),
    ]
    trainer = pl.Trainer(
        max_epochs=2,
        log_every_n_steps=2,
        gradient_clip_val=1.0,
        logger=TensorBoardLogger(tmp_path_factory.mktemp("tags"), name="run"),
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    assert trainer.log_dir is not None
    return Path(trainer.log_dir), {name for name, _ in model.named_modules() if name}


def test_every_tag_logged_is_named_on_the_page(run: tuple[Path, set[str]]) -> None:
    log_dir, layers = run
    unnamed = logged_tags(log_dir, layers) - documented_tags()
    assert not unnamed, f"logged but not in docs/concepts.md: {sorted(unnamed)}"


def test_every_tag_the_page_names_is_logged(run: tuple[Path, set[str]]) -> None:
    log_dir, layers = run
    missing = documented_tags() - logged_tags(log_dir, layers)
    assert not missing, f"in docs/concepts.md but never logged: {sorted(missing)}"


def test_the_page_reader_expands_sets_and_skips_schemes() -> None:
    tags = documented_tags()
    assert "grad_flow/grad_norm_step/{layer}" in tags
    assert "grad_flow/global/grad_norm_step_p95" in tags
    assert "activations/kurtosis/{layer}" in tags
    assert not any("<" in tag or "," in tag for tag in tags)


def test_each_logging_step_tag_is_its_epoch_tag_with_step_and_back(
    run: tuple[Path, set[str]],
) -> None:
    """The tags' one home names both ways: every scalar a logging step wrote is
    ``step_tag`` of an epoch tag the run also wrote, and ``epoch_tag`` gives that tag back;
    an epoch tag is no logging step's."""
    log_dir, _ = run
    scalars = {tag for acc in _accumulators(log_dir) for tag in acc.Tags()["scalars"]}
    steps = {tag: epoch_tag(tag) for tag in scalars}
    epochs = {tag for tag, epoch in steps.items() if epoch is None}
    assert epochs and len(epochs) < len(scalars)
    for tag, epoch in steps.items():
        if epoch is not None:
            assert epoch in epochs, (tag, epoch)
            assert step_tag(epoch) == tag
