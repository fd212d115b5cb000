"""Local random-token data for LitGPT's ``pretrain`` (``tests/test_litgpt.py``): no tokenizer,
no download. A module of its own so that LitGPT's CLI can name it as ``--data`` class path."""

from __future__ import annotations

from typing import Any

import torch
from litgpt.data import DataModule  # type: ignore[import-not-found]
from torch.utils.data import DataLoader


class RandomTokens(DataModule):  # type: ignore[misc]
    """``samples`` rows of ``max_seq_length + 1`` token ids below ``vocab``, from ``seed``."""

    def __init__(self, vocab: int = 64, samples: int = 256, seed: int = 0) -> None:
        super().__init__()
        self.vocab, self.samples, self.seed = vocab, samples, seed
        self.batch_size, self.seq = 1, 8

    def connect(
        self, tokenizer: Any = None, batch_size: int = 1, max_seq_length: int = 8, **_: Any
    ) -> None:
        self.batch_size, self.seq = batch_size, max_seq_length

    def _rows(self, seed: int, count: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.vocab, (count, self.seq + 1), generator=g)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self._rows(self.seed, self.samples), batch_size=self.batch_size)  # type: ignore[arg-type]

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self._rows(self.seed + 1, 8), batch_size=self.batch_size)  # type: ignore[arg-type]
