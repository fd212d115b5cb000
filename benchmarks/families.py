"""The model families of ``benchmarks/divergence.py`` beyond its sweep and recipes: runs as
users run them.

- ``byte-pre-ln``, ``byte-post-ln``: byte-level transformers (``nn.TransformerEncoderLayer``,
  vocabulary 256, d 64, 4 heads, 2 layers) on plain Adam without warm-up;
- ``gru``, ``gru2``, ``lstm2``: byte-level recurrent models (one or two layers) on RMSprop with
  clipping at 5;
- ``gpt``, ``gpt-wide``, ``gpt-deep``, ``gpt-6h``: the attention-instability family of Wortsman
  et al. 2023 ("Small-scale proxies for large-scale Transformer training instabilities", arXiv
  2309.14322): a byte-level pre-LN GPT, no biases, ``F.scaled_dot_product_attention``, with or
  without qk-layernorm, on AdamW (0.9, 0.95) with warm-up, cosine decay, clipping at 1 and z-loss
  1e-4, each on its own stdlib module's source; ``gpt-h32``, ``gpt-h32-deep``: the same with
  heads of 32, also at constant rates without warm-up, where the logits grow at lower rates;
- the output-logit family: the qk-layernorm GPT without z-loss; its twin adds z-loss 1e-4;
- ``resmlp``: a residual MLP of pre-LN blocks; ``bnmlp``: an MLP with BatchNorm; ``wine``: a
  small tabular MLP (13 features, 3 classes) for batches of 2 or 4;
- ``BNCNN1d``: a 1-d CNN with BatchNorm along a tabular set's features; ``DeepMLP``: an MLP of
  any depth, width and activation, no normalisation; ``PoolCNN2d``: a CNN with max pooling on
  the digits, no normalisation;
- ``ft``, ``ft-lora``: a pretrained byte-level GPT fine-tuned whole, or through low-rank
  adapters (:func:`LoRA`) on its frozen base;
- ``ft-mix``, ``ft-mix-lora``, ``ft-gru-mix``: the same fine-tunes (and a pretrained byte GRU's)
  on :data:`MIXED_DOCS`, documents that differ a lot in difficulty, one document a micro-batch:
  near-duplicate boilerplate (codec tables) beside English prose the base never saw, so one
  micro-batch's loss can be 2-3x the next one's;
- ``LNMLP``: an MLP with LayerNorm and GELU; ``GNCNN2d``: a CNN with GroupNorm and SiLU on the
  digits (the second fresh half's models, with ``DeepMLP``, ``ResMLP`` and ``BNMLP`` on new data);
- ``ReluMLP``, ``ReluCNN2d``, ``ReluCNN1d``: small ReLU networks without normalisation, where a
  too-high learning rate kills a layer whole;
- ``FrozenBackbone``, ``TwoBranch``, ``MixtureOfExperts``: healthy models whose layers get no
  gradient (or a gradient of exactly 0) for a while (:data:`IDLE`).

Data is the source text of Python's own modules, read as bytes, or scikit-learn's own sets:
nothing is downloaded.
"""

from __future__ import annotations

import argparse
import encodings.cp437
import encodings.cp850
import encodings.cp1252
import inspect
import math
import pydoc_data.topics
import tarfile
import typing
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional

__all__ = [
    "BNMLP",
    "BYTES",
    "GPT",
    "IDLE",
    "LNMLP",
    "BNCNN1d",
    "ByteGRU",
    "ByteLSTM",
    "ByteTransformer",
    "DeepMLP",
    "FrozenBackbone",
    "GNCNN2d",
    "LoRA",
    "MixtureOfExperts",
    "PoolCNN2d",
    "ReluCNN1d",
    "ReluCNN2d",
    "ReluMLP",
    "ResMLP",
    "Tabular",
    "TwoBranch",
    "byte_text",
]

BYTES = 256
SEQ = 64
TEXTS = {
    "argparse": argparse.__file__,
    "inspect": inspect.__file__,
    "typing": typing.__file__,
    "tarfile": tarfile.__file__,
    "cp1252": encodings.cp1252.__file__,
    "cp437": encodings.cp437.__file__,
    "cp850": encodings.cp850.__file__,
    "topics": pydoc_data.topics.__file__,
}
MIXED_DOCS = ("cp1252", "cp437", "cp850", "topics")
"""The heterogeneous fine-tuning corpus: three near-duplicate codec tables (boilerplate a model
learns in a few steps) and the prose of Python's help topics (unseen English): a micro-batch
drawn from one of them at random, so its loss swings with the document."""


def byte_text(name: str) -> torch.Tensor:
    """The source of the stdlib module ``name`` (a key of :data:`TEXTS`) as bytes."""
    return torch.tensor(list(Path(TEXTS[name]).read_bytes()), dtype=torch.long)


class ByteTransformer(nn.Module):
    """A byte-level causal transformer of ``nn.TransformerEncoderLayer`` (pre- or post-LN)."""

    def __init__(self, pre_ln: bool, d: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(BYTES, d)
        self.pos = nn.Embedding(SEQ, d)
        layer = nn.TransformerEncoderLayer(
            d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=pre_ln
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, BYTES)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos.weight[: x.shape[1]]
        return self.head(self.encoder(h, mask=self.mask, is_causal=True))  # type: ignore[no-any-return]


class ByteGRU(nn.Module):
    """A byte-level GRU language model (``layers`` stacked)."""

    def __init__(self, layers: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(BYTES, 32)
        self.gru = nn.GRU(32, 96, layers, batch_first=True)
        self.head = nn.Linear(96, BYTES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.embed(x))[0])  # type: ignore[no-any-return]


class ByteLSTM(nn.Module):
    """A byte-level two-layer LSTM language model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(BYTES, 32)
        self.lstm = nn.LSTM(32, 64, 2, batch_first=True)
        self.head = nn.Linear(64, BYTES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(x))[0])  # type: ignore[no-any-return]


class ResMLP(nn.Module):
    """A residual MLP of pre-LN blocks: ``inputs`` features, ``classes`` outputs."""

    def __init__(self, inputs: int, classes: int, d: int = 32, blocks: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(inputs, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
            for _ in range(blocks)
        )
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)  # type: ignore[no-any-return]


def BNMLP(inputs: int = 64, classes: int = 10) -> nn.Module:  # noqa: N802 (a model's name, as the classes')
    """An MLP with BatchNorm: ``inputs`` features (the 64 digit pixels), ``classes`` outputs."""
    return nn.Sequential(
        nn.Linear(inputs, 128), nn.BatchNorm1d(128), nn.ReLU(),
        nn.Linear(128, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, classes),
    )  # fmt: skip


def BNCNN1d(inputs: int = 30, classes: int = 2) -> nn.Module:  # noqa: N802
    """Two width-3 1-d convolutions with BatchNorm and ReLU along the ``inputs`` standardised
    features, averaged over them, then a linear head of ``classes`` outputs."""
    return nn.Sequential(
        nn.Unflatten(1, (1, inputs)),
        nn.Conv1d(1, 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU(),
        nn.Conv1d(8, 16, 3, padding=1), nn.BatchNorm1d(16), nn.ReLU(),
        nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(16, classes),
    )  # fmt: skip


def DeepMLP(  # noqa: N802
    inputs: int,
    classes: int,
    layers: int = 6,
    width: int = 64,
    activation: type[nn.Module] = nn.ReLU,
) -> nn.Module:
    """An MLP of ``layers`` linear layers of ``width`` units, ``activation`` between them, no
    normalisation: ``inputs`` features, ``classes`` outputs."""
    body: list[nn.Module] = []
    for index in range(layers - 1):
        body += [nn.Linear(inputs if index == 0 else width, width), activation()]
    return nn.Sequential(*body, nn.Linear(width, classes))


def PoolCNN2d() -> nn.Module:  # noqa: N802
    """Two 3x3 convolutions with ReLU, each followed by 2x2 max pooling, on the 8x8 digits, no
    normalisation, a linear head of 10 outputs."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4, 10),
    )  # fmt: skip


def LNMLP(inputs: int, classes: int, width: int = 64, layers: int = 3) -> nn.Module:  # noqa: N802
    """An MLP of ``layers`` hidden layers of ``width`` units, each a linear layer, LayerNorm and
    GELU: ``inputs`` features, ``classes`` outputs."""
    body: list[nn.Module] = []
    for index in range(layers):
        body += [nn.Linear(inputs if index == 0 else width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*body, nn.Linear(width, classes))


def GNCNN2d() -> nn.Module:  # noqa: N802
    """Two 3x3 convolutions with GroupNorm (4 groups) and SiLU on the 8x8 digits, averaged over
    the image, a linear head of 10 outputs."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.SiLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip


def Tabular() -> nn.Module:  # noqa: N802
    """A small tabular MLP: scikit-learn's wine set, 13 features, 3 classes."""
    return nn.Sequential(
        nn.Linear(13, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3)
    )


class LoRALinear(nn.Module):
    """A frozen ``base`` plus a trainable low-rank update ``B A`` (``A`` random, ``B`` zero)."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) / base.in_features**0.5)
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * (x @ self.a.T @ self.b.T)  # type: ignore[no-any-return]


def LoRA(base: GPT, rank: int = 4) -> GPT:  # noqa: N802
    """``base`` frozen, with low-rank adapters on every attention's ``qkv`` and ``proj``."""
    for p in base.parameters():
        p.requires_grad_(False)
    for block in base.blocks:
        attn = block.attn  # type: ignore[union-attr]
        attn.qkv = LoRALinear(attn.qkv, rank)  # type: ignore[union-attr]
        attn.proj = LoRALinear(attn.proj, rank)  # type: ignore[union-attr]
    return base


class SelfAttention(nn.Module):
    """Causal multi-head self-attention through ``F.scaled_dot_product_attention``, no biases;
    with ``qk_norm``, a LayerNorm on each head's queries and keys (Wortsman et al.'s fix)."""

    def __init__(self, d: int, heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        head = d // heads
        self.q_norm = nn.LayerNorm(head, bias=False) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(head, bias=False) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        out = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))  # type: ignore[no-any-return]


class Block(nn.Module):
    """A pre-LN GPT block without biases."""

    def __init__(self, d: int, heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d, bias=False)
        self.attn = SelfAttention(d, heads, qk_norm)
        self.ln2 = nn.LayerNorm(d, bias=False)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class GPT(nn.Module):
    """A byte-level pre-LN GPT: ``layers`` blocks of width ``d`` (heads of ``head``), no
    biases."""

    def __init__(self, qk_norm: bool, d: int = 64, layers: int = 2, head: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(BYTES, d)
        self.pos = nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(Block(d, d // head, qk_norm) for _ in range(layers))
        self.ln = nn.LayerNorm(d, bias=False)
        self.head = nn.Linear(d, BYTES, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos.weight[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))  # type: ignore[no-any-return]


# --- networks a too-high learning rate kills, and healthy runs whose layers idle ---------------


def ReluMLP(inputs: int, classes: int, width: int = 64) -> nn.Module:  # noqa: N802
    """Two ReLU layers of ``width`` units, no normalisation: ``inputs`` features, ``classes``
    outputs."""
    return nn.Sequential(
        nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, classes),
    )  # fmt: skip


def ReluCNN2d() -> nn.Module:  # noqa: N802
    """Two 3x3 convolutions with ReLU on the 8x8 digits, no normalisation, a linear head."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * 64, 10),
    )  # fmt: skip


def ReluCNN1d(inputs: int = 30, classes: int = 2) -> nn.Module:  # noqa: N802
    """Two width-3 1-d convolutions with ReLU along the ``inputs`` standardised features (the
    breast-cancer set's 30), no normalisation, a linear head."""
    return nn.Sequential(
        nn.Unflatten(1, (1, inputs)),
        nn.Conv1d(1, 8, 3, padding=1), nn.ReLU(),
        nn.Conv1d(8, 16, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * inputs, classes),
    )  # fmt: skip


IDLE = (100, 200)
"""The optimizer steps ``[start, end)`` over which the healthy idling models leave a part out:
the frozen backbone (frozen from the start until ``end``), the mixture's idle experts."""


class FrozenBackbone(nn.Module):
    """A ReLU MLP whose two-layer backbone is frozen (its output detached: its layers get no
    gradient) for the first :data:`IDLE`\\ [1] steps while the head trains, then fine-tuned
    whole: the usual linear probe, then unfreeze."""

    def __init__(self, inputs: int, classes: int, width: int = 64) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU()
        )
        self.head = nn.Linear(width, classes)
        self.frozen = True

    def at_step(self, step: int) -> None:
        """Unfreeze the backbone at :data:`IDLE`\\ [1]."""
        self.frozen = step < IDLE[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.backbone(x)
        return self.head(h.detach() if self.frozen else h)  # type: ignore[no-any-return]


class TwoBranch(nn.Module):
    """A ReLU MLP with a second branch (Linear, ReLU, Linear) added to its features for the first
    :data:`IDLE`\\ [0] steps, then unused to the end of the run (its layers get no gradient):
    an auxiliary path switched off, left in the module."""

    def __init__(self, inputs: int, classes: int, width: int = 64) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(inputs, width), nn.ReLU())
        self.main = nn.Sequential(nn.Linear(width, width), nn.ReLU())
        self.branch = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
        self.head = nn.Linear(width, classes)
        self.use_branch = True

    def at_step(self, step: int) -> None:
        """Drop the branch from :data:`IDLE`\\ [0] on."""
        self.use_branch = step < IDLE[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        out = self.main(h)
        if self.use_branch:
            out = out + self.branch(h)
        return self.head(out)  # type: ignore[no-any-return]


class MixtureOfExperts(nn.Module):
    """A ReLU trunk, then 4 experts (Linear, ReLU, Linear) mixed by a learned top-1 router,
    computed densely (every expert on every row, weighted by its gate, 0 unless chosen): an
    expert chosen by no row of a batch gets a gradient of exactly 0. Over :data:`IDLE` the
    router may not choose experts 2 and 3 (as a capacity limit drops them): they idle."""

    def __init__(self, inputs: int, classes: int, width: int = 32, experts: int = 4) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(inputs, width), nn.ReLU())
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
            for _ in range(experts)
        )
        self.head = nn.Linear(width, classes)
        self.register_buffer("allowed", torch.ones(experts, dtype=torch.bool))

    def at_step(self, step: int) -> None:
        """Only experts 0 and 1 over :data:`IDLE`."""
        self.allowed.fill_(True)
        if IDLE[0] <= step < IDLE[1]:
            self.allowed[2:] = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        logits = self.router(h).masked_fill(~self.allowed, -math.inf)
        probs = logits.softmax(-1)
        chosen = probs.argmax(-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(-1, chosen, probs.gather(-1, chosen))
        out = sum(gates[:, k : k + 1] * expert(h) for k, expert in enumerate(self.experts))
        return self.head(h + out)  # type: ignore[no-any-return]
