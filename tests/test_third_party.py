"""Models written by others, imported, not copied: Lightning's demos, a Hugging Face GPT-2 and
BERT, a timm ViT and ResNet, each built from a tiny config with no weights downloaded. Every
callback of the package runs at its defaults through ``Trainer.fit``: no exception, no warning
but findings about the model, and the logged values equal an independent plain-torch record
(forward hooks and ``p.grad`` read by the test, not by the library)."""

from __future__ import annotations

import math
import re
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from timm_shim import import_timm
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import (
    ActivationStatsCallback,
    DeadReLUCallback,
    FeatureMapCallback,
    GradFlowCallback,
    LayerTimeCallback,
    LightningHooksWarning,
    SaturationCallback,
)
from lightning_hooks.core import is_kind, torch_equivalent

from conftest import hooks_left, read_scalars

# What a callback may say about one of these models: findings, never a fault of ours.
_FINDINGS = re.compile(
    r"the model has no .* to watch at the defaults; this callback does nothing in this fit"
    r"|units dead in epoch|saturated on every training sample|held back after the first warning"
)


def _transformers() -> Any:
    return pytest.importorskip("transformers", reason="transformers is not installed")


def _timm() -> Any:
    try:
        return import_timm()  # torchvision without its fake kernels if it must: see timm_shim
    except ImportError as err:
        pytest.skip(f"timm is not installed ({err}): ./dev installs it with torchvision")


# --- the registry of third-party activations against what each class computes ---------------

_IDENTITY_OR_OTHER = {"LinearActivation", "XIELUActivation"}  # not activations of a torch kind


def _check_computes_as(act: nn.Module) -> None:
    """``act`` is positive where its torch equivalent is (what a dead unit's test reads), and
    keeps its bounds when bounded (what saturation reads)."""
    x = torch.linspace(-6.0, 6.0, 1201)
    kind = torch_equivalent(act)
    assert kind is not type(act), f"{type(act).__name__} is not recognised"
    with torch.no_grad():
        y, ref = act(x), kind()(x)
    if issubclass(kind, nn.Sigmoid | nn.Tanh | nn.Hardsigmoid):  # what saturation reads
        low, high = (-1.0, 1.0) if kind is nn.Tanh else (0.0, 1.0)
        assert low <= float(y.min()) and float(y.max()) <= high, type(act).__name__
        assert float(y[0]) < low + 0.01 and float(y[-1]) > high - 0.01, type(act).__name__
    else:
        assert torch.equal(y > 0, ref > 0), type(act).__name__


def test_every_hugging_face_activation_is_recognised_as_what_it_computes() -> None:
    activations = _transformers().activations
    for name, entry in activations.ACT2CLS.items():
        cls, kwargs = entry if isinstance(entry, tuple) else (entry, {})
        act = cls(**kwargs)
        if cls.__module__.startswith("torch.") or cls.__name__ in _IDENTITY_OR_OTHER:
            continue
        _check_computes_as(act)
        assert is_kind(act, torch_equivalent(act)), name
    for cls_name in ("GELUActivation", "NewGELUActivation", "QuickGELUActivation"):
        assert is_kind(getattr(activations, cls_name)(), nn.GELU)


def test_every_timm_activation_is_recognised_as_what_it_computes() -> None:
    layers = _timm().layers
    for cls_name in ("GELU", "GELUTanh", "QuickGELU", "Swish", "Mish", "HardSwish"):
        _check_computes_as(getattr(layers, cls_name)())
    for cls_name in ("Sigmoid", "Tanh", "HardSigmoid"):
        _check_computes_as(getattr(layers, cls_name)())


# --- the models, wrapped in a small LightningModule ---------------------------------------------


class Recorded(pl.LightningModule):
    """Records per optimizer step each owning module's gradient norm and the global one, and
    per training forward the outputs of :attr:`watched` (forward hooks of the test's own)."""

    watched: tuple[str, ...] = ()

    def __init__(self, net: nn.Module, loss: Callable[[nn.Module, Any], torch.Tensor]) -> None:
        super().__init__()
        self.net = net
        self.loss = loss
        self.grads: list[dict[str, float]] = []
        self.outputs: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._handles: list[Any] = []

    def forward(self, x: torch.Tensor) -> Any:
        out = self.net(x)
        return getattr(out, "logits", out)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(self.net, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def watch(self, *names: str) -> None:
        for name in names:
            module = self.get_submodule(name)
            self._handles.append(module.register_forward_hook(self._record(name)))

    def unwatch(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _record(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            if module.training and torch.is_grad_enabled():
                self.outputs[name].append(output.detach().double().clone())

        return hook

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        norms: dict[str, float] = {}
        for name, module in self.named_modules():
            own = [p.grad for p in module.parameters(recurse=False) if p.grad is not None]
            if own and name:
                norms[name] = math.sqrt(sum(float(g.double().pow(2).sum()) for g in own))
        unique = [p.grad for p in self.parameters() if p.grad is not None]  # a tied one once
        norms["global"] = float(torch.nn.utils.get_total_norm(unique))
        self.grads.append(norms)


def _tokens(vocab: int, n: int = 12, length: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, vocab, (n, length), generator=g), torch.arange(n) % 3)


def _gpt2() -> tuple[nn.Module, Any, TensorDataset, tuple[str, ...]]:
    t = _transformers()
    config = t.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    net = t.GPT2LMHeadModel(config)
    assert type(net.transformer.h[0].mlp.act).__name__ == "NewGELUActivation"

    def loss(net: nn.Module, batch: Any) -> torch.Tensor:
        return net(input_ids=batch[0], labels=batch[0]).loss  # type: ignore[no-any-return]

    return net, loss, _tokens(100), ("net.transformer.h.0.mlp.act", "net.transformer.h.1.mlp.c_fc")


def _bert() -> tuple[nn.Module, Any, TensorDataset, tuple[str, ...]]:
    t = _transformers()
    config = t.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=3,
    )  # fmt: skip
    net = t.BertForSequenceClassification(config)
    assert type(net.bert.encoder.layer[0].intermediate.intermediate_act_fn).__name__ == (
        "GELUActivation"
    )

    def loss(net: nn.Module, batch: Any) -> torch.Tensor:
        return net(input_ids=batch[0], labels=batch[1]).loss  # type: ignore[no-any-return]

    act = "net.bert.encoder.layer.0.intermediate.intermediate_act_fn"
    return net, loss, _tokens(100), (act, "net.bert.pooler.activation")


def _images(n: int = 12, size: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, size, size, generator=g), torch.arange(n) % 10)


def _classify(net: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(net(batch[0]), batch[1])


def _vit() -> tuple[nn.Module, Any, TensorDataset, tuple[str, ...]]:
    net = _timm().create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
        depth=2, num_heads=2, num_classes=10,
    )  # fmt: skip
    return net, _classify, _images(), ("net.blocks.0.mlp.act", "net.blocks.1.mlp.fc1")


def _resnet() -> tuple[nn.Module, Any, TensorDataset, tuple[str, ...]]:
    net = _timm().create_model("resnet18", pretrained=False, num_classes=10)
    return net, _classify, _images(), ("net.layer1.0.act1", "net.layer4.1.conv2")


MODELS = {"gpt2": _gpt2, "bert": _bert, "timm-vit": _vit, "timm-resnet": _resnet}
# The callbacks with nothing to watch at the defaults: no sigmoid or tanh module in a GPT-2 (BERT's
# pooler has a Tanh); DeadReLUCallback watches the GELUs of every one of them.
IDLE = {
    "gpt2": {"SaturationCallback"},
    "bert": set(),
    "timm-vit": {"SaturationCallback"},
    "timm-resnet": {"SaturationCallback"},
}


def _idle(messages: list[str]) -> set[str]:
    return {m.split(":")[0] for m in messages if "to watch at the defaults" in m}


def _callbacks() -> list[pl.Callback]:
    return [
        GradFlowCallback(),
        ActivationStatsCallback(),
        DeadReLUCallback(),
        SaturationCallback(),
        LayerTimeCallback(),
        FeatureMapCallback(),
    ]


def _fit_quietly(trainer: Any, model: Any, *data: Any) -> list[str]:
    """Fit; any warning but ours fails (pytest's filters), ours are returned to be judged."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LightningHooksWarning)
        trainer.fit(model, *data)
    return [str(w.message) for w in caught if issubclass(w.category, LightningHooksWarning)]


def _trainer(trainer_cls: Any, root: Path, logger: Any) -> Any:
    return trainer_cls(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=logger(str(root), name="tb", version=0),
        callbacks=_callbacks(),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        limit_train_batches=3,
    )


@pytest.mark.parametrize("name", list(MODELS))
def test_every_callback_at_its_defaults_on_a_third_party_model(name: str, tmp_path: Path) -> None:
    net, loss, data, watched = MODELS[name]()
    model = Recorded(net, loss)
    model.train_dataloader = lambda: DataLoader(data, batch_size=4)  # type: ignore[method-assign]
    model.watch(*watched)
    trainer = _trainer(pl.Trainer, tmp_path, pl.loggers.TensorBoardLogger)
    ours = _fit_quietly(trainer, model)
    model.unwatch()
    assert all(_FINDINGS.search(m) for m in ours), ours
    assert _idle(ours) == IDLE[name], ours
    assert trainer.global_step == 3 and hooks_left(model) == []
    scalars = read_scalars(tmp_path)
    last = {tag: values[-1][1] for tag, values in scalars.items()}
    for layer in ("global", *[n for n in model.grads[0] if n != "global"][:3]):
        tag = "grad_flow/global/grad_norm" if layer == "global" else f"grad_flow/grad_norm/{layer}"
        want = sum(step[layer] for step in model.grads) / len(model.grads)
        assert math.isclose(last[tag], want, rel_tol=1e-4), (tag, last[tag], want)
    for layer in watched:
        outs = model.outputs[layer]
        assert len(outs) == 3
        mean = float(sum(o.sum() for o in outs) / sum(o.numel() for o in outs))
        assert math.isclose(last[f"activations/mean/{layer}"], mean, rel_tol=1e-4, abs_tol=1e-6)
    act = model.get_submodule(watched[0])
    if is_kind(act, (nn.ReLU, nn.GELU, nn.SiLU)):  # measured by DeadReLUCallback too
        outs = model.outputs[watched[0]]
        zero = float(sum((o <= 0).double().mean() for o in outs) / len(outs))
        assert math.isclose(last[f"dead_relu/zero_fraction/{watched[0]}"], zero, rel_tol=1e-6)
    assert any(tag.startswith("layer_time/") for tag in scalars)
    assert any(tag.startswith("feature_map/abs_mean/") for tag in scalars)


class BuiltInConfigureModel(Recorded):
    """Lightning's recipe for large and sharded models: the layers are built in
    ``configure_model``, which Lightning calls after the callbacks' ``setup``."""

    def __init__(self) -> None:
        super().__init__(nn.Sequential(), _classify)  # no parameter until configure_model

    def configure_model(self) -> None:
        if len(self.net) == 0:  # type: ignore[arg-type]
            self.net.extend([nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, 10)])


def test_layers_built_in_configure_model_are_watched(tmp_path: Path) -> None:
    model = BuiltInConfigureModel()
    model.train_dataloader = lambda: DataLoader(_images(size=8), batch_size=4)  # type: ignore[method-assign]
    trainer = _trainer(pl.Trainer, tmp_path, pl.loggers.TensorBoardLogger)
    ours = _fit_quietly(trainer, model)
    assert all(_FINDINGS.search(m) for m in ours), ours
    assert _idle(ours) == {"SaturationCallback"}, ours  # no sigmoid or tanh: nothing else idles
    assert trainer.global_step == 3 and hooks_left(model) == []
    last = {tag: values[-1][1] for tag, values in read_scalars(tmp_path).items()}
    for layer in ("global", "net.1", "net.3"):
        tag = "grad_flow/global/grad_norm" if layer == "global" else f"grad_flow/grad_norm/{layer}"
        want = sum(step[layer] for step in model.grads) / len(model.grads)
        assert math.isclose(last[tag], want, rel_tol=1e-4), (tag, last[tag], want)
    assert "dead_relu/zero_fraction/net.2" in last
    assert "activations/mean/net.2" in last


# --- Lightning's own demos, on the lightning.pytorch Trainer --------------------------------------


def test_lightning_demo_models_at_the_defaults(tmp_path: Path) -> None:
    lightning_pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.demos import LightningTransformer
    from lightning.pytorch.demos.boring_classes import BoringModel, DemoModel, RandomDataset
    from lightning.pytorch.loggers import TensorBoardLogger

    class OfflineTransformer(LightningTransformer):  # type: ignore[misc]
        """Lightning's demo with its WikiText2 download replaced by random tokens."""

        def prepare_data(self) -> None:
            pass

        def train_dataloader(self) -> DataLoader[Any]:
            g = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, 50, (12, 9), generator=g)
            return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)

    for i, model in enumerate((BoringModel(), DemoModel(), OfflineTransformer(vocab_size=50))):
        trainer = _trainer(lightning_pl.Trainer, tmp_path / str(i), TensorBoardLogger)
        if isinstance(model, LightningTransformer):  # two inputs: the probe runs as a batch
            trainer.callbacks[-1].forward_fn = lambda module, probe: module(probe, probe)
        with warnings.catch_warnings():
            # torch's own advice about nn.Transformer's fast path, at construction of the demo
            warnings.filterwarnings("ignore", message=".*enable_nested_tensor is True.*")
            data = [DataLoader(RandomDataset(32, 12), batch_size=4)] if i == 1 else []
            ours = _fit_quietly(trainer, model, *data)  # DemoModel brings no data of its own
        assert all(_FINDINGS.search(m) for m in ours), ours
        # No activation module in any of them (F.relu, nn.Transformer's functional relu).
        assert _idle(ours) == {"DeadReLUCallback", "SaturationCallback"}, ours
        assert trainer.global_step == 3 and hooks_left(model) == []
        scalars = read_scalars(tmp_path / str(i))
        assert "grad_flow/global/grad_norm" in scalars
        assert any(t.startswith("activations/mean/") for t in scalars)


def test_torchvisions_bottleneck_relu_at_two_widths_is_measured_at_the_defaults(
    tmp_path: Path,
) -> None:
    """torchvision's ``Bottleneck`` calls one in-place ``relu`` at 64, 64 and 256 channels. Before,
    ``DeadReLUCallback()`` refused the second width in its hook and was disabled for the fit."""
    _timm()  # torchvision, importable beside this torch (timm_shim)
    from torchvision.models.resnet import Bottleneck, ResNet

    torch.manual_seed(0)
    net = ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10)  # a ResNet-50's blocks, one per stage
    model = Recorded(net, _classify)
    model.train_dataloader = lambda: DataLoader(_images(), batch_size=4)  # type: ignore[method-assign]
    model.watch("net.layer1.0.relu")
    trainer = _trainer(pl.Trainer, tmp_path, pl.loggers.TensorBoardLogger)
    ours = _fit_quietly(trainer, model)
    model.unwatch()
    assert all(_FINDINGS.search(m) for m in ours), ours
    assert "DeadReLUCallback" not in _idle(ours)
    last = {tag: values[-1][1] for tag, values in read_scalars(tmp_path).items()}
    calls = model.outputs["net.layer1.0.relu"]
    assert [o.shape[1] for o in calls] == [64, 64, 256] * 3
    for row, width in (("net.layer1.0.relu", 64), ("net.layer1.0.relu-256", 256)):
        outs = [o for o in calls if o.shape[1] == width]
        zero = float(sum((o <= 0).double().mean() for o in outs) / len(outs))
        assert math.isclose(last[f"dead_relu/zero_fraction/{row}"], zero, rel_tol=1e-6), row
        fired = torch.cat([o.movedim(1, -1).reshape(-1, width) for o in outs]) > 0
        dead = int((fired.sum(dim=0) == 0).sum())
        assert last[f"dead_relu/dead_count/{row}"] == dead, row
