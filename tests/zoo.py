"""A zoo of tiny models like those users train, each recording its own reference statistics in
plain torch (no library code): per optimizer step, each owning module's gradient norm, the
global gradient norm (a shared parameter once), the norm of d loss / d output of the outputs
passed through :meth:`ZooModule.mark`, and the mean of the outputs passed through
:meth:`ZooModule.act`."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BackboneFinetuning
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import DataLoader, TensorDataset

ROOT = "<root>"


def _dense(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_dense() if grad.is_sparse else grad


class ZooModule(pl.LightningModule):
    """Records the reference; subclasses build the model and the batches."""

    probe_input: Any = None  # FeatureMapCallback(input_fn=...) when a batch is not (input, ...)

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[dict[str, Any]] = []
        self.acts: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
        self._sq: dict[str, float] = defaultdict(float)

    def mark(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Record d loss / d ``tensor`` under ``name`` (the module whose output it is)."""
        if tensor.requires_grad:
            tensor.register_hook(lambda g: self._sq.__setitem__(name, self._sq[name] + _sq(g)))
        return tensor

    def act(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Record ``tensor`` as an output of module ``name`` in a training forward."""
        if self.training and torch.is_grad_enabled():
            total = self.acts[(self.current_epoch, name)]
            total[0] += float(tensor.detach().double().sum())
            total[1] += tensor.numel()
        return tensor

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
        grads: dict[str, float] = {}
        for name, module in self.named_modules():
            own = [
                _dense(p.grad).double()
                for p in module.parameters(recurse=False)
                if id(p) in stepped and p.grad is not None
            ]
            if own:
                grads[name or ROOT] = math.sqrt(sum(float(g.pow(2).sum()) for g in own))
        unique = [
            _dense(p.grad).double()
            for p in self.parameters()  # yields a shared parameter once
            if id(p) in stepped and p.grad is not None
        ]
        total = float(torch.nn.utils.get_total_norm(unique)) if unique else math.nan
        # A layer's output gradient counts in the step of the optimizer that steps the layer.
        mine = {
            name or ROOT
            for name, module in self.named_modules()
            if any(id(p) in stepped for p in module.parameters(recurse=False))
        }
        outs = {k: math.sqrt(v) for k, v in self._sq.items() if k in mine}
        self.steps.append(
            {"epoch": self.current_epoch, "grad": grads, "global": total, "out": outs}
        )
        for name in outs:
            del self._sq[name]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _sq(grad: torch.Tensor) -> float:
    return float(grad.double().pow(2).sum())


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class BasicBlock(nn.Module):
    """ResNet's basic block: conv-BN-ReLU-conv-BN, residual add, one in-place ReLU used twice."""

    def __init__(self, owner: ZooModule, prefix: str, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self._owner = [owner]  # not a submodule
        self._prefix = prefix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        zoo, p = self._owner[0], self._prefix
        out = zoo.mark(f"{p}.conv1", self.conv1(x))
        out = zoo.act(f"{p}.relu", self.relu(self.bn1(out)))
        out = zoo.mark(f"{p}.bn2", self.bn2(self.conv2(out)))
        return zoo.act(f"{p}.relu", self.relu(out + x))


class ResNetZoo(ZooModule):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = BasicBlock(self, "block", 8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act("stem", self.mark("stem", self.stem(x)))
        h = self.block(h).mean(dim=(2, 3))
        return self.mark("fc", self.act("fc", self.fc(h)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def train_dataloader(self) -> DataLoader[Any]:
        g = _gen(0)
        data = TensorDataset(torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 4, (16,)))
        return DataLoader(data, batch_size=8)


class GPTZoo(ZooModule):
    """A decoder: token embedding tied to the output layer, learned positions on a container,
    causal attention, and a learnable temperature on the LightningModule itself."""

    probe_input = staticmethod(lambda batch: batch[0][:, :-1])

    def __init__(self, vocab: int = 16, dim: int = 8, length: int = 6) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleDict(
            {
                "ln": nn.LayerNorm(dim),
                "attn": nn.MultiheadAttention(dim, 2, batch_first=True),
                "mlp": nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)),
            }
        )
        self.blocks.wpe = nn.Parameter(torch.randn(length, dim) * 0.1)  # a container's own
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, GPT-2 style
        self.temperature = nn.Parameter(torch.ones(()))
        self.register_buffer("mask", torch.triu(torch.ones(length, length, dtype=torch.bool), 1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.mark("wte", self.wte(tokens)) + self.blocks.wpe[: tokens.shape[1]]
        a = self.blocks["ln"](h)
        a, _ = self.blocks["attn"](a, a, a, attn_mask=self.mask, need_weights=False)
        h = h + self.mark("blocks.attn", a)
        h = h + self.mark("blocks.mlp.2", self.blocks["mlp"](h))
        return self.mark("lm_head", self.act("lm_head", self.lm_head(h))) / self.temperature

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(torch.randint(0, 16, (16, 7), generator=_gen(1))), 8)


class BERTZoo(ZooModule):
    """An encoder: token embedding, nn.TransformerEncoder, a classifier on the first token."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.cls = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.mark("embed", self.embed(tokens)))
        return self.mark("cls", self.act("cls", self.cls(h[:, 0])))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, y = batch
        return nn.functional.cross_entropy(self(tokens), y)

    def train_dataloader(self) -> DataLoader[Any]:
        g = _gen(2)
        data = TensorDataset(torch.randint(0, 16, (16, 5), generator=g), torch.randint(0, 3, (16,)))
        return DataLoader(data, batch_size=8)


class LSTMZoo(ZooModule):
    """Variable-length sequences, packed, through an LSTM; a head on the last hidden state."""

    probe_input = staticmethod(lambda batch: (batch[0], batch[1]))

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 6)
        self.lstm = nn.LSTM(6, 8, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, lengths = inputs
        packed = pack_padded_sequence(self.embed(tokens), lengths, batch_first=True)
        _, (h, _) = self.lstm(packed)
        return self.mark("head", self.act("head", self.head(self.mark("lstm", h[-1]))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, lengths, y = batch
        return nn.functional.mse_loss(self((tokens, lengths)), y)

    def train_dataloader(self) -> DataLoader[Any]:
        g = _gen(3)
        lengths = torch.tensor([7, 6, 6, 5, 4, 3, 3, 2] * 2)
        tokens = torch.randint(0, 12, (16, 7), generator=g)
        y = torch.randn(16, 1, generator=g)
        return DataLoader(TensorDataset(tokens, lengths, y), batch_size=8)


class RecommenderZoo(ZooModule):
    """Users and items as sparse embeddings (sparse gradients), a dot product and a bias."""

    probe_input = staticmethod(lambda batch: (batch[0], batch[1]))

    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Embedding(20, 4, sparse=True)
        self.items = nn.Embedding(30, 4, sparse=True)
        self.bias = nn.Linear(4, 1)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        u = self.mark("users", self.act("users", self.users(inputs[0])))
        v = self.mark("items", self.items(inputs[1]))
        return (u * v).sum(1, keepdim=True) + self.mark("bias", self.bias(u * v))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        users, items, y = batch
        return nn.functional.mse_loss(self((users, items)), y)

    def train_dataloader(self) -> DataLoader[Any]:
        g = _gen(4)
        users, items = torch.randint(0, 20, (16,), generator=g), torch.randint(0, 30, (16,))
        return DataLoader(TensorDataset(users, items, torch.randn(16, 1, generator=g)), 8)


class GANZoo(ZooModule):
    """Manual optimization, two optimizers: the generator's loss flows back through the
    discriminator; the reference counts a layer's output gradient only in its own step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.probe_input = lambda batch: batch[0].repeat(1, 2)  # a latent batch for the probe
        self.gen = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Tanh())
        self.disc = nn.Sequential(nn.Linear(2, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.gen(z)  # type: ignore[no-any-return]

    def _gen(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mark("gen.0", self.gen[0](z))
        return self.gen[3](self.mark("gen.2", self.gen[2](self.gen[1](h))))

    def _disc(self, x: torch.Tensor, marked: bool) -> torch.Tensor:
        mark = self.mark if marked else (lambda name, t: t)
        h = mark("disc.0", self.act("disc.0", self.disc[0](x)))
        return mark("disc.2", self.disc[2](self.disc[1](h)))  # type: ignore[operator]

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        g_opt, d_opt = self.optimizers()  # type: ignore[misc]
        z = torch.randn(real.shape[0], 4, generator=_gen(batch_idx))
        fake = self._gen(z)
        ones = torch.ones(real.shape[0], 1)
        g_loss = nn.functional.binary_cross_entropy_with_logits(self._disc(fake, False), ones)
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        logits = torch.cat([self._disc(real, True), self._disc(fake.detach(), True)])
        target = torch.cat([ones, torch.zeros_like(ones)])
        d_loss = nn.functional.binary_cross_entropy_with_logits(logits, target)
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.Adam(self.gen.parameters(), lr=1e-3),
            torch.optim.Adam(self.disc.parameters(), lr=1e-3),
        )

    def train_dataloader(self) -> DataLoader[Any]:
        real = torch.randn(16, 2, generator=_gen(5)) * 0.5 + 1.0
        return DataLoader(TensorDataset(real), batch_size=8)


class LightningGANZoo(ZooModule):
    """Lightning's basic GAN recipe (manual optimization, ``toggle_optimizer`` around each
    optimizer's backward and step, ``zero_grad`` after the step), tiny: the generator's block is
    Linear, BatchNorm1d, LeakyReLU, then Linear and Tanh; the discriminator Linear, LeakyReLU,
    Linear and Sigmoid, trained with BCE."""

    toggle = True

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.probe_input = lambda batch: batch[0].repeat(1, 2)  # a latent batch for the probe
        self.generator = nn.Sequential(
            nn.Linear(4, 8), nn.BatchNorm1d(8, 0.8), nn.LeakyReLU(0.2), nn.Linear(8, 2), nn.Tanh()
        )
        self.discriminator = nn.Sequential(
            nn.Linear(2, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1), nn.Sigmoid()
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        g = self.generator
        h = self.mark("generator.0", g[0](z))
        return g[4](self.mark("generator.3", g[3](g[2](g[1](h)))))  # type: ignore[no-any-return]

    def _disc(self, x: torch.Tensor, marked: bool) -> torch.Tensor:
        mark = self.mark if marked else (lambda name, t: t)
        d = self.discriminator
        h = mark("discriminator.0", self.act("discriminator.0", d[0](x)))
        return d[3](mark("discriminator.2", d[2](d[1](h))))  # type: ignore[no-any-return]

    def _toggle(self, optimizer: Any) -> None:
        if self.toggle:
            self.toggle_optimizer(optimizer)

    def _untoggle(self, optimizer: Any) -> None:
        if self.toggle:
            self.untoggle_optimizer(optimizer)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (imgs,) = batch
        optimizer_g, optimizer_d = self.optimizers()  # type: ignore[misc]
        z = torch.randn(imgs.shape[0], 4, generator=_gen(batch_idx)).type_as(imgs)
        bce = nn.functional.binary_cross_entropy
        # train generator
        self._toggle(optimizer_g)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        # Untoggled, this backward also feeds the discriminator's next step: its gradients
        # accumulate until optimizer_d.step().
        g_loss = bce(self._disc(self(z), not self.toggle), valid)
        self.manual_backward(g_loss)
        optimizer_g.step()
        optimizer_g.zero_grad()
        self._untoggle(optimizer_g)
        # train discriminator
        self._toggle(optimizer_d)
        real_loss = bce(self._disc(imgs, True), valid)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        fake_loss = bce(self._disc(self(z).detach(), True), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.manual_backward(d_loss)
        optimizer_d.step()
        optimizer_d.zero_grad()
        self._untoggle(optimizer_d)

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
        return [opt_g, opt_d], []

    def train_dataloader(self) -> DataLoader[Any]:
        real = torch.randn(24, 2, generator=_gen(5)) * 0.5 + 1.0
        return DataLoader(TensorDataset(real), batch_size=8)


class UntoggledGANZoo(LightningGANZoo):
    """The same recipe without ``toggle_optimizer``: the generator's backward also fills the
    discriminator's gradients, which ``optimizer_d`` never zeroes before its own backward."""

    toggle = False


class FinetuneZoo(ZooModule):
    """A backbone frozen by Lightning's BackboneFinetuning, unfrozen at epoch 1 (it calls
    ``optimizer.add_param_group``), and a head trained throughout."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.backbone[1](self.mark("backbone.0", self.backbone[0](x)))
        h = self.act("backbone.3", self.backbone[3](self.backbone[2](h)))
        return self.mark("head", self.head(h))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        head = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(head, lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        g = _gen(6)
        return DataLoader(
            TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)), 8
        )

    @staticmethod
    def finetuning() -> BackboneFinetuning:
        return BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=False)


ZOO: tuple[type[ZooModule], ...] = (
    ResNetZoo,
    GPTZoo,
    BERTZoo,
    LSTMZoo,
    RecommenderZoo,
    GANZoo,
    LightningGANZoo,
    UntoggledGANZoo,
    FinetuneZoo,
)
