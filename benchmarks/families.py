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
- ``ft``, ``ft-lora``: a pretrained byte-level GPT fine-tuned whole, or through low-rank
  adapters (:func:`LoRA`) on its frozen base;
- ``ft-mix``, ``ft-mix-lora``, ``ft-gru-mix``: the same fine-tunes (and a pretrained byte GRU's)
  on :data:`MIXED_DOCS`, documents that differ a lot in difficulty, one document a micro-batch:
  near-duplicate boilerplate (codec tables) beside English prose the base never saw, so one
  micro-batch's loss can be 2-3x the next one's.

Data is the source text of Python's own modules, read as bytes: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import encodings.cp437
import encodings.cp850
import encodings.cp1252
import inspect
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
    "ByteGRU",
    "ByteLSTM",
    "ByteTransformer",
    "LoRA",
    "ResMLP",
    "Tabular",
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


def BNMLP() -> nn.Module:  # noqa: N802 (a model's name, as the classes')
    """An MLP with BatchNorm on the 64 digit pixels, 10 classes."""
    return nn.Sequential(
        nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(),
        nn.Linear(128, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10),
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
