"""Transformer instability statistics: largest attention logit, output logits' log-partition."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.distributions import Categorical
from torch.nn import functional
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import GradFlowCallback
from lightning_hooks.core.stats import attention as attention_module
from lightning_hooks.core.stats.attention import MhaCall
from lightning_hooks.core.stats.attention import mha_logit_chunks as attention_chunks
from lightning_hooks.core.stats.stability import StabilityStats

from conftest import TinyMLP, epoch_end_step, hooks_left, make_trainer, read_scalars

STEPS, EVERY = 4, 2  # one epoch of 4 steps; steps 0 (the epoch's first), 1 and 3 are logging steps


def _is_logging_step(step: int, batch_idx: int) -> bool:
    """The callbacks' schedule: Lightning's logging steps and each epoch's first step."""
    return batch_idx == 0 or (step + 1) % EVERY == 0


def reference_logit_max(
    mha: nn.MultiheadAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
) -> tuple[float, float, torch.Tensor]:
    """Plain torch, seq-first ``[L, N, E]`` inputs, torch's own input projections: the largest
    logit, the smallest per-head mean attention entropy and the per-head sums of the rows'
    entropies, per query position (every row attends to a key here)."""
    heads, e = mha.num_heads, mha.embed_dim
    b = mha.in_proj_bias
    if mha._qkv_same_embed_dim:
        q, k, _ = functional._in_projection_packed(query, key, key, mha.in_proj_weight, b)
    else:
        bq, bk, bv = b.chunk(3) if b is not None else (None, None, None)
        w = (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
        q, k, _ = functional._in_projection(query, key, key, *w, bq, bk, bv)
    n = query.shape[1]
    q = q.reshape(q.shape[0], n, heads, e // heads).permute(1, 2, 0, 3)  # N, H, L, d
    k = k.reshape(k.shape[0], n, heads, e // heads).permute(1, 2, 0, 3)  # N, H, S, d
    logits = torch.einsum("nhld,nhsd->nhls", q, k) / math.sqrt(e // heads)
    for mask in (attn_mask, None if key_padding_mask is None else key_padding_mask[:, None, None]):
        if mask is not None and mask.dtype == torch.bool:
            logits = logits.masked_fill(mask, -math.inf)
        elif mask is not None:  # TransformerEncoder hands its masks on as float (-inf)
            logits = logits + mask
    entropy = Categorical(logits=logits).entropy()  # [N, H, L]
    sums = entropy.sum((0, 2))
    return logits.max().item(), entropy.mean((0, 2)).min().item(), sums / entropy[0, 0].numel()


class TinyTransformer(pl.LightningModule):
    """Two post-LN encoder layers (causal, padded keys) and a token classifier; 4 batches."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Linear(4, 16)
        layer = nn.TransformerEncoderLayer(
            16, 2, dim_feedforward=32, dropout=0.0, batch_first=batch_first
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 5)
        self.expected_attn: dict[str, list[float]] = defaultdict(list)
        self.expected_entropy: dict[str, list[float]] = defaultdict(list)
        self.entropy_sums: dict[str, list[torch.Tensor]] = defaultdict(list)  # per head
        self.expected_logz: list[torch.Tensor] = []
        self.batch_idx = -1
        for name, module in self.named_modules():
            if isinstance(module, nn.MultiheadAttention):
                module.register_forward_pre_hook(self._capture(name), with_kwargs=True)

    def _logging_step(self) -> bool:
        return self.training and _is_logging_step(self.trainer.global_step, self.batch_idx)

    def _capture(self, name: str) -> Any:
        def hook(mha: nn.MultiheadAttention, args: Any, kwargs: dict[str, Any]) -> None:
            if self._logging_step():
                query = args[0] if self.batch_first is False else args[0].transpose(0, 1)
                expected, entropy, sums = reference_logit_max(
                    mha, query, query, kwargs["attn_mask"], kwargs["key_padding_mask"]
                )
                self.expected_attn[name].append(expected)
                self.expected_entropy[name].append(entropy)
                self.entropy_sums[name].append(sums)

        return hook

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        length = x.shape[1] if self.batch_first else x.shape[0]
        causal = torch.ones(length, length, dtype=torch.bool).triu(1)
        return self.head(self.encoder(self.embed(x), mask=causal, src_key_padding_mask=pad))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch  # x: [N, L, 4], y: [N, L]
        self.batch_idx = batch_idx
        pad = torch.zeros(y.shape, dtype=torch.bool)
        pad[:, 1:3] = True  # positions 1 and 2 are padding, and large: they would give the max
        x = torch.where(pad[..., None], x * 10, x)
        logits = self(x if self.batch_first else x.transpose(0, 1), pad)
        logits = logits if self.batch_first else logits.transpose(0, 1)
        if self._logging_step():
            self.expected_logz.append(torch.logsumexp(logits.detach(), -1).flatten())
        return functional.cross_entropy(logits.reshape(-1, 5), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4 * STEPS, 6, 4, generator=g) * 3
        y = torch.randint(0, 5, (4 * STEPS, 6), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=4)


# budget 1: the logits are made a query row at a time (a long sequence's path)
@pytest.mark.parametrize(("batch_first", "budget"), [(True, None), (False, None), (True, 1)])
def test_transformer_logs_attention_logits_and_logz_equal_to_torch(
    tmp_path: Path, batch_first: bool, budget: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if budget is not None:
        monkeypatch.setattr(attention_module, "LOGIT_BUDGET", budget)
    model = TinyTransformer(batch_first)
    trainer = make_trainer(
        tmp_path, callbacks=[GradFlowCallback()], max_steps=STEPS, log_every_n_steps=EVERY
    )
    trainer.fit(model)
    scalars = read_scalars(tmp_path)
    attention = [f"encoder.layers.{i}.self_attn" for i in range(2)]
    assert sorted(t for t in scalars if t.startswith("stability/attn_logit_max/")) == [
        f"stability/attn_logit_max/{name}" for name in attention
    ]
    for name in attention:
        assert len(model.expected_attn[name]) == 3  # steps 0, 1 and 3 only
        [(step, value)] = scalars[f"stability/attn_logit_max/{name}"]
        assert step == epoch_end_step(STEPS)
        assert value == pytest.approx(max(model.expected_attn[name]), rel=1e-5)
    logz = torch.cat(model.expected_logz)
    assert len(model.expected_logz) == 3
    end = epoch_end_step(STEPS)
    assert scalars["stability/logit_logz/head"] == [(end, pytest.approx(logz.mean().item()))]
    assert scalars["stability/logit_logz_max/head"] == [(end, pytest.approx(logz.max().item()))]
    # Each logging step (steps 0, 1 and 3) has its own values, under ``_step`` tags.
    for name in attention:
        got = scalars[f"stability/attn_logit_max_step/{name}"]
        assert [s for s, _ in got] == [0, 1, 3]
        assert [v for _, v in got] == pytest.approx(model.expected_attn[name], rel=1e-5)
        got = scalars[f"stability/attn_entropy_min_step/{name}"]
        assert [v for _, v in got] == pytest.approx(model.expected_entropy[name], rel=1e-5)
        # the epoch: each head's mean over the rows of the three logging steps' forwards (batches
        # of 4 sequences of 6 each), the smallest head
        per_position = torch.stack(model.entropy_sums[name]).sum(0)
        want = (per_position / (3 * 4)).min().item()
        epoch = (epoch_end_step(STEPS), pytest.approx(want))
        assert scalars[f"stability/attn_entropy_min/{name}"] == [epoch]
    for tag, reduce in (("logit_logz_step", torch.mean), ("logit_logz_max_step", torch.amax)):
        got = scalars[f"stability/{tag}/head"]
        want = [reduce(z).item() for z in model.expected_logz]
        assert [s for s, _ in got] == [0, 1, 3] and [v for _, v in got] == pytest.approx(want)
    assert hooks_left(model) == [
        f"{name}._forward_pre_hooks" for name in attention
    ]  # the test's own capture hooks only


class ClassifierMLP(TinyMLP):
    """TinyMLP with a 3-way head; records the logging steps' log-partitions."""

    def __init__(self) -> None:
        super().__init__()
        self.net[4] = nn.Linear(16, 3)
        self.expected: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        if _is_logging_step(self.trainer.global_step, batch_idx):
            self.expected.append(torch.logsumexp(logits.detach(), -1))
        return functional.cross_entropy(logits, (y[:, 0] > 0).long())


def test_mlp_has_no_attention_tags_and_logs_its_heads_logz(tmp_path: Path) -> None:
    model = ClassifierMLP()
    make_trainer(tmp_path, callbacks=[GradFlowCallback()], log_every_n_steps=EVERY).fit(model)
    scalars = read_scalars(tmp_path)
    assert sorted(t for t in scalars if t.startswith("stability/")) == [
        "stability/logit_logz/net.4",
        "stability/logit_logz_max/net.4",
        "stability/logit_logz_max_step/net.4",
        "stability/logit_logz_step/net.4",
    ]
    logz = torch.cat(model.expected)
    assert len(model.expected) == 3
    assert scalars["stability/logit_logz/net.4"][0][1] == pytest.approx(logz.mean().item())
    assert scalars["stability/logit_logz_max/net.4"][0][1] == pytest.approx(logz.max().item())
    assert hooks_left(model) == []


def test_a_regressor_with_one_output_logs_no_log_partition(tmp_path: Path) -> None:
    """The log-partition of a single output is the output itself: the regressor's output layer
    logs none, and no layer before it stands in (a classifier's head logs it, above)."""
    make_trainer(tmp_path, callbacks=[GradFlowCallback()], log_every_n_steps=EVERY).fit(TinyMLP())
    scalars = read_scalars(tmp_path)
    assert "grad_flow/grad_norm/net.4" in scalars
    assert [t for t in scalars if t.startswith("stability/")] == []


class _HooksSeen(pl.Callback):
    """The forward hooks on each module during the forward of each logging step."""

    def __init__(self) -> None:
        self.per_step: list[dict[str, int]] = []

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any
    ) -> None:
        if _is_logging_step(trainer.global_step, trainer.fit_loop.batch_idx):
            modules = pl_module.named_modules()
            self.per_step.append({n: len(m._forward_hooks) for n, m in modules if n})


def test_once_the_output_layer_is_known_only_its_log_partition_hook_runs(tmp_path: Path) -> None:
    """The other parameter owners have no log-partition to measure after the first logging
    step: their hooks are off, and the output layer's values stay those of plain torch."""
    model, seen = ClassifierMLP(), _HooksSeen()
    make_trainer(tmp_path, callbacks=[GradFlowCallback(), seen], log_every_n_steps=EVERY).fit(model)
    first, *later = seen.per_step
    assert len(later) == 2
    for hooks in later:
        assert hooks["net.4"] == first["net.4"]  # the output layer's: output gradient, log Z
        assert hooks["net.0"] == first["net.0"] - 1  # its log Z hook is off
    scalars = read_scalars(tmp_path)
    want = [z.mean().item() for z in model.expected]
    got = scalars["stability/logit_logz_step/net.4"]
    assert [v for _, v in got] == pytest.approx(want)


def test_stability_off_logs_no_stability_tag(tmp_path: Path) -> None:
    model = ClassifierMLP()
    make_trainer(tmp_path, callbacks=[GradFlowCallback(stability=False)]).fit(model)
    scalars = read_scalars(tmp_path)
    assert "grad_flow/grad_norm/net.4" in scalars
    assert not [t for t in scalars if t.startswith("stability/")]


def test_stability_argument_is_checked() -> None:
    with pytest.raises(TypeError, match=r"GradFlowCallback\(stability=1\)"):
        GradFlowCallback(stability=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("batched", [True, False])
def test_logit_max_with_separate_projections_bias_k_zero_attn_and_float_mask(
    batched: bool,
) -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, kdim=3, vdim=3, add_bias_kv=True, add_zero_attn=True)
    with torch.no_grad():
        mha.bias_k.normal_()
    query, key = torch.randn(5, 2, 8), torch.randn(7, 2, 3)
    mask = torch.randn(5, 7)  # a float mask is added to the logits
    if not batched:
        query, key = query[:, 0], key[:, 0]
    (logits,) = attention_chunks(mha, MhaCall(query, key, attn_mask=mask), budget=1 << 30)
    peak = logits.amax()
    # Independent: torch's projections, the extra keys appended per head by hand.
    q, k, _ = functional._in_projection(
        query, key, key, mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight,
        *mha.in_proj_bias.chunk(3),
    )  # fmt: skip
    q, k = q.reshape(*q.shape[:-1], 2, 4), k.reshape(*k.shape[:-1], 2, 4)
    if batched:  # [N, L, h, d]: the batch in front of the positions
        q, k = q.transpose(0, 1), k.transpose(0, 1)
    bias_k = mha.bias_k.reshape(2, 4)
    logits = torch.einsum("...lhd,...shd->...hls", q, k) / 2 + mask
    extra = torch.einsum("...lhd,hd->...hl", q, bias_k) / 2
    expected = max(logits.max().item(), extra.max().item(), 0.0)
    assert peak.item() == pytest.approx(expected, rel=1e-6)
    assert peak.dtype == torch.float32 and peak.dim() == 0


def _ops(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    with torch.profiler.profile() as prof:
        model(x)
    return {e.key: e.count for e in prof.key_averages()}


def test_quiet_steps_run_no_tensor_op() -> None:
    model = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0)
    x = torch.randn(3, 2, 8)
    bare = _ops(model, x)
    stat = StabilityStats().attach(model)
    assert stat.registry is not None
    stat.registry.logging_step = False
    assert _ops(model, x) == bare
    stat.registry.logging_step = True
    assert "aten::logsumexp" in set(_ops(model, x)) - set(bare)
    stat.reset()
    model(x)
    stat.end_step()
    assert sorted(stat.tags(stat.result())) == [
        "stability/attn_entropy_min/self_attn",
        "stability/attn_logit_max/self_attn",
        "stability/logit_logz/norm2",
        "stability/logit_logz_max/norm2",
    ]
    stat.remove()


class RepeatedBatchTransformer(TinyTransformer):
    """Every batch holds the same 4 samples: a replayed batch after a resume is the same data."""

    def train_dataloader(self) -> DataLoader[Any]:
        x, y = next(iter(super().train_dataloader()))
        return DataLoader(TensorDataset(x.repeat(STEPS, 1, 1), y.repeat(STEPS, 1)), batch_size=4)


@pytest.mark.filterwarnings("ignore:.*checkpoint that ended before the epoch ended.*")
def test_resumed_mid_epoch_logs_what_the_whole_fit_logs(tmp_path: Path) -> None:
    def fit(root: Path, ckpt_path: Path | None = None, **kwargs: Any) -> dict[str, float]:
        torch.manual_seed(0)
        callbacks = [GradFlowCallback(), *kwargs.pop("callbacks", [])]
        trainer = make_trainer(root, callbacks=callbacks, **kwargs)
        trainer.fit(RepeatedBatchTransformer(batch_first=True), ckpt_path=ckpt_path)
        return {t: v[-1][1] for t, v in read_scalars(root).items() if t.startswith("stability/")}

    whole = fit(tmp_path / "whole")
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    fit(tmp_path / "first", callbacks=[ckpt], enable_checkpointing=True, max_steps=2)
    path = next((tmp_path / "ckpt").glob("*step=2.ckpt"))
    saved = torch.load(path, weights_only=False)["callbacks"][GradFlowCallback().state_key]
    assert saved["1:StabilityStats"]["layers"]
    again = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    resumed = fit(tmp_path / "second", path, callbacks=[again], enable_checkpointing=True)
    assert len(whole) == 12  # 6 per epoch, 6 of the last logging step
    assert resumed == pytest.approx(whole, rel=1e-5)


@pytest.mark.parametrize("mask", ["2-d", "3-d", "padding"])
def test_mha_logit_chunks_are_the_logits_a_row_at_a_time(mask: str) -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, add_bias_kv=True, add_zero_attn=True, batch_first=True)
    x = torch.randn(3, 5, 8)
    kwargs: dict[str, Any] = {}
    if mask == "2-d":
        kwargs["attn_mask"] = torch.randn(5, 5)
    if mask == "3-d":
        kwargs["attn_mask"] = torch.rand(3 * 2, 5, 5) > 0.5
    if mask == "padding":
        kwargs["key_padding_mask"] = torch.arange(5) >= torch.tensor([[5], [3], [4]])
    (full,) = attention_chunks(mha, MhaCall(x, x, **kwargs), budget=1 << 30)
    per_row = 3 * 2 * 7  # batch x heads x (5 keys, bias_k, zero_attn)
    for budget in (1, 2 * per_row):
        chunks = list(attention_chunks(mha, MhaCall(x, x, **kwargs), budget=budget))
        assert all(c.numel() <= max(budget, per_row) for c in chunks)
        assert len(chunks) == (5 if budget == 1 else 3)
        torch.testing.assert_close(torch.cat(chunks, -2), full, rtol=0, atol=0)
