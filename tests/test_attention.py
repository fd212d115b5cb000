"""Attention statistics of ``scaled_dot_product_attention`` and eager softmax attention, per
module: equal to plain torch on the same q, k and mask, through ``Trainer.fit`` and TensorBoard."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from ops import OpsPerStep
from timm_shim import import_timm
from torch import nn
from torch.distributions import Categorical
from torch.nn import functional
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import GradFlowCallback
from lightning_hooks.cli import main
from lightning_hooks.core.hooks.registry import HookRegistry
from lightning_hooks.core.stats import attention
from lightning_hooks.core.stats.attention import (
    AttentionCapture,
    attention_head_entropy,
    sdpa_logit_chunks,
)
from lightning_hooks.core.stats.stability import StabilityStats
from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.report import _fmt

from conftest import epoch_end_step, make_trainer, read_scalars
from support import StepWindow
from syncs import count_syncs
from tensorboard_server import charts, read_layouts


def sdpa_logits_whole(q: torch.Tensor, k: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """The whole logits: :func:`sdpa_logit_chunks` in one chunk."""
    (logits,) = sdpa_logit_chunks(q, k, budget=1 << 30, **kwargs)
    return logits


def peak_and_entropy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest logit and the smallest per-head mean entropy, as ``StabilityStats`` logs."""
    peak, total, count = attention_head_entropy(logits)
    return peak, torch.where(count > 0, total / count.clamp(min=1), torch.inf).amin()


STEPS, EVERY = 4, 2  # one epoch of 4 steps; steps 0 (the epoch's first), 1 and 3 are logging steps
LENGTH, BATCH, VOCAB = 8, 4, 50


def reference(q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor) -> tuple[float, float]:
    """Plain torch on ``q, k: [B, H, L, d]``, ``keep`` broadcast to ``[B, H, L, S]``: the largest
    kept logit ``q.k / sqrt(d)`` and the smallest per-head mean of the rows' entropies."""
    peak, total, rows = reference_heads(q, k, keep)
    return peak, min(t / n for t, n in zip(total, rows, strict=True))


def reference_heads(
    q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor
) -> tuple[float, list[float], list[float]]:
    """:func:`reference`'s largest logit, and per head the sum of the rows' entropies and the
    number of rows."""
    logits = torch.einsum("bhld,bhsd->bhls", q.double(), k.double()) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~keep, -math.inf)
    entropy = Categorical(logits=logits).entropy()  # [B, H, L]; every row keeps a key here
    rows = entropy.shape[0] * entropy.shape[2]
    return logits.max().item(), entropy.sum(dim=(0, 2)).tolist(), [float(rows)] * q.shape[1]


def pooled(calls: list[tuple[float, list[float], list[float]]]) -> tuple[float, float]:
    """The largest logit over ``calls`` and the smallest head's mean entropy over all their
    rows (what ``attn_entropy_min`` logs over a period)."""
    total = [sum(c[1][h] for c in calls) for h in range(len(calls[0][1]))]
    rows = [sum(c[2][h] for c in calls) for h in range(len(calls[0][2]))]
    return max(c[0] for c in calls), min(t / n for t, n in zip(total, rows, strict=True))


# --- the pure kernels -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mask", ["none", "causal", "bool", "float", "gqa", "gqa-causal", "scale", "3-d"]
)
def test_softmax_of_sdpa_logits_gives_sdpa_output(mask: str) -> None:
    """The logits' softmax times v is what sdpa returns: the same scale, mask and heads."""
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    kwargs: dict[str, Any] = {}
    if mask.startswith("gqa"):
        k, v, kwargs["enable_gqa"] = k[:, :2], v[:, :2], True
    if mask.endswith("causal"):
        kwargs["is_causal"] = True
    if mask == "bool":
        kwargs["attn_mask"] = torch.rand(2, 1, 5, 6) > 0.3
        kwargs["attn_mask"][..., 0] = True
    if mask == "float":
        kwargs["attn_mask"] = torch.randn(5, 6)
    if mask == "scale":
        kwargs["scale"] = 0.7
    if mask == "3-d":
        q, k, v = q[0], k[0], v[0]
    logits = sdpa_logits_whole(q, k, **kwargs)
    values = v.repeat_interleave(2, dim=-3) if mask.startswith("gqa") else v
    got = torch.softmax(logits, -1) @ values
    want = functional.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float", "gqa-causal", "3-d"])
def test_logit_chunks_are_the_logits_a_row_budget_at_a_time(mask: str) -> None:
    """Each chunk holds at most the budget (or one query row), and together they are
    :func:`sdpa_logits`: the statistics, sums and maxima over rows, are the same."""
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 6, 8)
    kwargs: dict[str, Any] = {}
    if mask.endswith("causal"):
        kwargs["is_causal"] = True
    if mask == "bool":
        kwargs["attn_mask"] = torch.rand(2, 1, 5, 6) > 0.3
    if mask == "float":
        kwargs["attn_mask"] = torch.randn(5, 6)
    if mask.startswith("gqa"):
        k, kwargs["enable_gqa"] = k[:, :2], True
    if mask == "3-d":
        q, k = q[0], k[0]
    full = sdpa_logits_whole(q, k, **kwargs)
    per_row = full[..., :1, :].numel()
    for budget in (1, per_row, 2 * per_row + 1, full.numel()):
        chunks = list(sdpa_logit_chunks(q, k, budget=budget, **kwargs))
        assert all(c.numel() <= max(budget, per_row) for c in chunks)
        assert len(chunks) == -(-5 // max(1, budget // per_row))
        torch.testing.assert_close(torch.cat(chunks, -2), full, rtol=0, atol=0)


def test_a_long_sequence_is_measured_a_chunk_at_a_time_within_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through ``StabilityStats``: every chunk handed on is within the budget, and the
    statistics equal those of the whole logits."""
    net = NanoGPT(2)
    ids = torch.randint(0, VOCAB, (2, LENGTH))
    per_row = 2 * 4 * LENGTH  # batch x heads x keys
    sizes: list[int] = []

    def measured(budget: int) -> dict[str, float]:
        monkeypatch.setattr(attention, "LOGIT_BUDGET", budget)
        torch.manual_seed(0)  # the same dropout
        with StabilityStats().attach(net) as stat:
            record = stat._capture._record  # type: ignore[union-attr]
            stat._capture._record = lambda n, c: (sizes.append(c.numel()), record(n, c))  # type: ignore[union-attr]
            net(ids).sum().backward()
            stat.end_step()
            return stat.tags(stat.result())

    whole = measured(1 << 30)
    assert sizes and max(sizes) == LENGTH * per_row
    sizes.clear()
    chunked = measured(3 * per_row)
    assert max(sizes) == 3 * per_row and len(sizes) == 2 * 3  # 2 layers, rows 3 + 3 + 2
    assert chunked == pytest.approx(whole, rel=1e-6)


def test_attention_stats_against_categorical_entropy() -> None:
    logits = torch.randn(3, 4, 5, 6) * 3
    keep = torch.rand(3, 1, 5, 6) > 0.4
    keep[..., 2] = True
    peak, entropy = peak_and_entropy(logits.masked_fill(~keep, -torch.inf))
    q = logits  # reference() takes q, k: pass logits * sqrt(d) as q and the identity as k
    want = reference(q * math.sqrt(6), torch.eye(6).expand(3, 4, 6, 6), keep)
    assert (peak.item(), entropy.item()) == pytest.approx(want, rel=1e-5)


def test_a_fully_masked_row_is_left_out_and_all_masked_gives_no_value() -> None:
    logits = torch.tensor([[[[1.0, 1.0], [-torch.inf, -torch.inf]]]])
    peak, entropy = peak_and_entropy(logits)
    assert (peak.item(), entropy.item()) == pytest.approx((1.0, math.log(2)))
    peak, entropy = peak_and_entropy(torch.full((1, 2, 3, 3), -torch.inf))
    assert (peak.item(), entropy.item()) == (-math.inf, math.inf)


# --- models ---------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention (``model.py``), with ``kv_heads`` < ``heads`` for grouped queries."""

    def __init__(self, width: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, width // heads
        self.c_attn = nn.Linear(width, (heads + 2 * kv_heads) * self.d)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.c_attn(x).split([self.heads * self.d, *[self.kv_heads * self.d] * 2], 2)
        q = q.view(b, n, self.heads, self.d).transpose(1, 2)
        k = k.view(b, n, self.kv_heads, self.d).transpose(1, 2)
        v = v.view(b, n, self.kv_heads, self.d).transpose(1, 2)
        y = functional.scaled_dot_product_attention(
            q, k, v, dropout_p=0.1, is_causal=True, enable_gqa=self.kv_heads != self.heads
        )
        return self.c_proj(y.transpose(1, 2).reshape(b, n, -1))


class NanoGPT(nn.Module):
    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 16)
        self.h = nn.ModuleList(CausalSelfAttention(16, 4, kv_heads) for _ in range(2))
        self.lm_head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) * 4  # large logits: the entropy is far from uniform
        for block in self.h:
            x = x + block(x)
        return self.lm_head(x)


Capture = Callable[["Fit", str, nn.Module], None]


class Fit(pl.LightningModule):
    """Trains ``net`` on padded token batches; on the logging steps ``capture`` records each
    attention module's plain-torch reference into :attr:`expected`."""

    def __init__(
        self, net: nn.Module, loss: Callable[..., torch.Tensor], capture: Capture, padded: bool
    ) -> None:
        super().__init__()
        self.net, self.loss, self.padded = net, loss, padded
        self.expected: dict[str, list[tuple[float, list[float], list[float]]]] = defaultdict(list)
        self.keep = torch.ones(BATCH, LENGTH, dtype=torch.bool)
        self.batch_idx = -1
        capture(self, "", net)

    def logging_step(self) -> bool:
        step = self.trainer.global_step
        return self.training and (self.batch_idx == 0 or (step + 1) % EVERY == 0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.batch_idx = batch_idx
        ids, keep = batch
        self.keep = keep if self.padded else torch.ones_like(keep)  # nanoGPT takes no mask
        return self.loss(self.net, ids, keep)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, VOCAB, (BATCH * STEPS, LENGTH), generator=g)
        lengths = torch.randint(3, LENGTH + 1, (BATCH * STEPS,), generator=g)
        keep = torch.arange(LENGTH) < lengths[:, None]  # right padding
        return DataLoader(TensorDataset(ids, keep), batch_size=BATCH)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.view(x.shape[0], x.shape[1], heads, -1).transpose(1, 2)


def _record(fit: Fit, name: str, q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    if fit.logging_step():
        keep = fit.keep[:, None, None, :]
        if causal:
            keep = keep & torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()
        fit.expected[name].append(reference_heads(q.detach(), k.detach(), keep))


def _gpt2_capture(fit: Fit, _: str, net: nn.Module) -> None:
    for i, block in enumerate(net.transformer.h):
        attn = block.attn

        def hook(
            m: nn.Module, args: Any, out: torch.Tensor, i: int = i, h: int = attn.num_heads
        ) -> None:
            q, k, _ = out.split(out.shape[-1] // 3, dim=2)
            _record(fit, f"net.transformer.h.{i}.attn", _heads(q, h), _heads(k, h), causal=True)

        attn.c_attn.register_forward_hook(hook)


def _bert_capture(fit: Fit, _: str, net: nn.Module) -> None:
    for i, layer in enumerate(net.bert.encoder.layer):
        attn = layer.attention.self
        got: dict[str, torch.Tensor] = {}

        def keep_q(
            m: nn.Module, args: Any, out: torch.Tensor, got: dict[str, torch.Tensor] = got
        ) -> None:
            got["q"] = out

        def hook(
            m: nn.Module,
            args: Any,
            out: torch.Tensor,
            i: int = i,
            got: dict[str, torch.Tensor] = got,
            h: int = attn.num_attention_heads,
        ) -> None:
            name = f"net.bert.encoder.layer.{i}.attention.self"
            _record(fit, name, _heads(got["q"], h), _heads(out, h), causal=False)

        attn.query.register_forward_hook(keep_q)
        attn.key.register_forward_hook(hook)


def _nano_capture(fit: Fit, _: str, net: nn.Module) -> None:
    for i, block in enumerate(net.h):

        def hook(m: nn.Module, args: Any, out: torch.Tensor, i: int = i, b: Any = block) -> None:
            q, k, _ = out.split([b.heads * b.d, *[b.kv_heads * b.d] * 2], 2)
            k = _heads(k, b.kv_heads).repeat_interleave(b.heads // b.kv_heads, dim=1)
            _record(fit, f"net.h.{i}", _heads(q, b.heads), k, causal=True)

        block.c_attn.register_forward_hook(hook)


def _gpt2(impl: str) -> Fit:
    t = pytest.importorskip("transformers")
    config = t.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=LENGTH,
        bos_token_id=0, eos_token_id=0, initializer_range=0.5, attn_implementation=impl,
    )  # fmt: skip
    net = t.GPT2LMHeadModel(config)

    def loss(net: nn.Module, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return net(input_ids=ids, attention_mask=keep.long(), labels=ids).loss  # type: ignore[no-any-return]

    return Fit(net, loss, _gpt2_capture, padded=True)


def _bert(impl: str) -> Fit:
    t = pytest.importorskip("transformers")
    config = t.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=LENGTH, num_labels=3,
        initializer_range=0.5, attn_implementation=impl,
    )  # fmt: skip
    net = t.BertForSequenceClassification(config)

    def loss(net: nn.Module, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        labels = ids[:, 0] % 3
        return net(input_ids=ids, attention_mask=keep.long(), labels=labels).loss  # type: ignore[no-any-return]

    return Fit(net, loss, _bert_capture, padded=True)


def _llama_capture(fit: Fit, _: str, net: nn.Module) -> None:
    """RoPE'd q and k recomputed from each attention's inputs with the model's own weights;
    grouped-query keys repeated to the query heads."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    for i, layer in enumerate(net.model.layers):
        attn = layer.self_attn

        def hook(m: nn.Module, args: Any, kwargs: dict[str, Any], i: int = i) -> None:
            h = kwargs.get("hidden_states", args[0] if args else None)
            b, n, _ = h.shape
            q = m.q_proj(h).view(b, n, -1, m.head_dim).transpose(1, 2)
            k = m.k_proj(h).view(b, n, -1, m.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, *kwargs["position_embeddings"])
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            _record(fit, f"net.model.layers.{i}.self_attn", q, k, causal=True)

        attn.register_forward_pre_hook(hook, with_kwargs=True)


def _llama(impl: str, padded: bool) -> Fit:
    """A tiny Llama with grouped-query attention (4 query heads, 2 key/value heads): unpadded,
    its sdpa path calls sdpa with ``enable_gqa=True``; padded, it repeats the keys itself."""
    t = pytest.importorskip("transformers")
    config = t.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH,
        initializer_range=0.5, attn_implementation=impl, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    net = t.LlamaForCausalLM(config)

    def loss(net: nn.Module, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        mask = keep.long() if padded else None
        return net(input_ids=ids, attention_mask=mask, labels=ids).loss  # type: ignore[no-any-return]

    return Fit(net, loss, _llama_capture, padded=padded)


def _vit_capture(fit: Fit, _: str, net: nn.Module) -> None:
    for i, block in enumerate(net.blocks):
        attn = block.attn

        def hook(
            m: nn.Module, args: Any, out: torch.Tensor, i: int = i, h: int = attn.num_heads
        ) -> None:
            b, n, _ = out.shape
            q, k, _ = out.reshape(b, n, 3, h, -1).permute(2, 0, 3, 1, 4)
            if fit.logging_step():
                keep = torch.ones(n, n, dtype=torch.bool)  # bidirectional, no mask
                fit.expected[f"net.blocks.{i}.attn"].append(
                    reference_heads(q.detach(), k.detach(), keep)
                )

        attn.qkv.register_forward_hook(hook)


def _vit() -> Fit:
    """timm's ViT (fused attention: ``F.scaled_dot_product_attention``) on 32x32 images."""
    try:
        timm = import_timm()  # torchvision without its fake kernels if it must: see timm_shim
    except ImportError as err:
        pytest.skip(f"timm is not installed ({err}): ./dev installs it with torchvision")
    net = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
        num_classes=3, attn_drop_rate=0.1,
    )  # fmt: skip
    assert all(block.attn.fused_attn for block in net.blocks)

    def loss(net: nn.Module, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(int(ids.sum()))
        images = torch.randn(ids.shape[0], 3, 32, 32, generator=g) * 3
        return functional.cross_entropy(net(images), ids[:, 0] % 3)

    return Fit(net, loss, _vit_capture, padded=False)


def _nano(kv_heads: int) -> Fit:
    def loss(net: nn.Module, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return functional.cross_entropy(net(ids).flatten(0, 1), ids.flatten())

    return Fit(NanoGPT(kv_heads), loss, _nano_capture, padded=False)


MODELS: dict[str, Callable[[], Fit]] = {
    "gpt2-sdpa": lambda: _gpt2("sdpa"),
    "gpt2-eager": lambda: _gpt2("eager"),
    "bert-sdpa": lambda: _bert("sdpa"),
    "bert-eager": lambda: _bert("eager"),
    "nanogpt": lambda: _nano(4),
    "nanogpt-gqa": lambda: _nano(2),
    "timm-vit": _vit,
    "llama-gqa-sdpa": lambda: _llama("sdpa", padded=False),
    "llama-gqa-sdpa-padded": lambda: _llama("sdpa", padded=True),
    "llama-gqa-eager-padded": lambda: _llama("eager", padded=True),
}


# A budget of one element: every chunk is one query row (long sequences' path), on padded and
# causal masks with a query dimension (GPT-2, Llama), a padding mask without (BERT), GQA.
CHUNKED = ("gpt2-sdpa", "gpt2-eager", "bert-sdpa", "llama-gqa-sdpa-padded", "nanogpt-gqa")


@pytest.mark.parametrize(
    ("name", "budget"),
    [(n, None) for n in sorted(MODELS)] + [(n, 1) for n in CHUNKED],
)
def test_attention_statistics_equal_plain_torch_through_fit(
    name: str, budget: int | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if budget is not None:
        monkeypatch.setattr(attention, "LOGIT_BUDGET", budget)
    fit = MODELS[name]()
    trainer = make_trainer(
        tmp_path, callbacks=[GradFlowCallback()], max_steps=STEPS, log_every_n_steps=EVERY
    )
    trainer.fit(fit)
    scalars = read_scalars(tmp_path)
    modules = sorted(fit.expected)
    assert len(modules) == 2
    for stat in ("attn_logit_max", "attn_entropy_min"):
        assert sorted(t for t in scalars if t.startswith(f"stability/{stat}/")) == [
            f"stability/{stat}/{m}" for m in modules
        ]
    for module in modules:
        expected = fit.expected[module]
        assert len(expected) == 3  # steps 0, 1 and 3 only
        for i, stat in enumerate(("attn_logit_max", "attn_entropy_min")):
            got = scalars[f"stability/{stat}_step/{module}"]
            assert [s for s, _ in got] == [0, 1, 3]
            each = [
                pooled([e])[i] for e in expected
            ]  # a window of one forward of a logging step each
            assert [v for _, v in got] == pytest.approx(each, rel=1e-5)
            want = pooled(expected)[i]  # the epoch: every head's rows of the three forwards
            epoch = (epoch_end_step(STEPS), pytest.approx(want, rel=1e-5))
            assert scalars[f"stability/{stat}/{module}"] == [epoch]


def _ops(model: nn.Module, ids: torch.Tensor) -> dict[str, int]:
    with torch.profiler.profile() as prof:
        model(ids)
    return {e.key: e.count for e in prof.key_averages()}


def _entropy_min(batches: list[torch.Tensor]) -> float:
    torch.manual_seed(0)
    net = NanoGPT(2)
    with StabilityStats().attach(net) as stat:
        for ids in batches:  # micro-batches of one step
            net(ids).sum().backward()
        stat.end_step()
        tags = stat.tags(stat.result())
    # h.0: its input does not go through the attention dropout of nanoGPT's blocks
    (value,) = [v for t, v in tags.items() if t == "stability/attn_entropy_min/h.0"]
    return value


def test_the_entropy_of_micro_batches_is_the_entropy_of_their_batch() -> None:
    """Per-head sums and row counts, not a value per call: two micro-batches of 2 log what one
    batch of 4 logs (the smallest of their own two means would not)."""
    ids = torch.randint(0, VOCAB, (4, LENGTH), generator=torch.Generator().manual_seed(3))
    whole, halves = _entropy_min([ids]), _entropy_min([ids[:2], ids[2:]])
    assert halves == pytest.approx(whole, rel=1e-6)
    assert min(_entropy_min([ids[:2]]), _entropy_min([ids[2:]])) < whole * (1 - 1e-3)


def test_quiet_steps_run_the_same_ops_and_logging_steps_pay() -> None:
    net = NanoGPT(2)
    ids = torch.randint(0, VOCAB, (2, LENGTH))
    bare = _ops(net, ids)
    stat = StabilityStats().attach(net)
    assert stat.registry is not None
    stat.registry.set_logging_step(False)
    assert _ops(net, ids) == bare
    stat.registry.set_logging_step(True)
    assert "aten::special_entr" in set(_ops(net, ids)) - set(bare)
    stat.remove()
    assert _ops(net, ids) == bare


def test_capture_leaves_the_mode_when_the_forward_raises() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            functional.scaled_dot_product_attention(x, x, x)
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(4, 4), Fails())
    seen: list[str] = []
    with HookRegistry(model) as registry:
        capture = AttentionCapture(lambda name, _: seen.append(name)).attach(registry)
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.randn(2, 3, 4))
        assert torch._C._len_torch_function_stack() == 0 and not capture._stack
        functional.scaled_dot_product_attention(*[torch.randn(1, 2, 4)] * 3)  # outside a module
    assert seen == ["1"]


# --- where it cannot see ----------------------------------------------------------------------


class FusedAttention(nn.Module):
    """Calls the fused CPU kernel directly: no ``scaled_dot_product_attention`` call to see."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.view(x.shape[0], x.shape[1], 2, -1).transpose(1, 2)
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, is_causal=True)
        return out[0].transpose(1, 2).flatten(2)  # type: ignore[no-any-return]


def test_a_fused_kernel_called_directly_warns_once_and_logs_nothing() -> None:
    model = nn.Sequential(nn.Linear(8, 8), FusedAttention(), nn.Linear(8, 3))
    with StabilityStats().attach(model) as stat:
        with pytest.warns(LightningHooksWarning, match=r"1 module\(s\) look like attention.*: 1$"):
            model(torch.randn(2, 5, 8)).sum().backward()
            stat.end_step()
        model(torch.randn(2, 5, 8)).sum().backward()  # no second warning: errors would raise
        stat.end_step()
        assert not [t for t in stat.tags(stat.result()) if "attn" in t]


class AttentionClassifier(nn.Module):
    """A model whose own class is named as attention, around an attention it makes visible."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.attn = FusedAttention() if fused else CausalSelfAttention(8, 2, 2)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x))  # type: ignore[no-any-return]


def test_a_model_named_as_attention_encloses_the_attention_seen() -> None:
    model = AttentionClassifier(fused=False)
    with StabilityStats().attach(model) as stat:
        model(torch.randn(2, 5, 8)).sum().backward()  # a warning would raise here
        stat.end_step()
        assert "stability/attn_entropy_min/attn" in stat.tags(stat.result())
    model = AttentionClassifier(fused=True)  # nothing seen: the model is named by its class
    named = r"2 module\(s\).*: AttentionClassifier, attn$"
    with StabilityStats().attach(model) as stat, pytest.warns(LightningHooksWarning, match=named):
        model(torch.randn(2, 5, 8)).sum().backward()
        stat.end_step()


class TwoScales(nn.Module):
    """One module, two attention calls: 4 heads over the tokens, then 1 head pooling them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.view(x.shape[0], x.shape[1], 4, -1).transpose(1, 2)
        y = functional.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(2)
        pooled = functional.scaled_dot_product_attention(y[:, None, :1], y[:, None], y[:, None])
        return y + pooled[:, 0]


class TwoScalesModel(pl.LightningModule):
    """An embedding, :class:`TwoScales`, a head; 2 batches."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.head = nn.Linear(4, 8), TwoScales(), nn.Linear(8, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.head(self.mix(self.embed(batch[0]))).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(torch.randn(8, 5, 4)), batch_size=4)


def test_calls_with_other_heads_are_left_out_of_the_entropy_with_one_warning(
    tmp_path: Path,
) -> None:
    """Through ``Trainer.fit`` at the defaults: the 1-head call of a module whose first call
    had 4 heads cannot pool into its per-head sums; it is left out of the entropy (one warning),
    counted in the largest logit, and the fit goes on."""

    trainer = make_trainer(tmp_path, callbacks=[GradFlowCallback()], max_epochs=1)
    with pytest.warns(LightningHooksWarning, match=r"'mix' made attention calls of 4 and of 1"):
        trainer.fit(TwoScalesModel())
    scalars = read_scalars(tmp_path)
    assert "stability/attn_entropy_min/mix" in scalars
    assert "stability/attn_logit_max/mix" in scalars


def test_an_error_in_the_capture_is_reported_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The capture runs inside the model's forward: an error of ours there is the guard's
    (reported once, the callback disabled), not the forward's."""
    from lightning_hooks.core.hooks.guard import STRICT_ENV
    from lightning_hooks.core.stats import stability

    monkeypatch.setenv(STRICT_ENV, "0")

    def boom(logits: torch.Tensor) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(stability, "attention_head_entropy", boom)
    model = TwoScalesModel()
    trainer = make_trainer(tmp_path, callbacks=[GradFlowCallback()], max_epochs=1)
    with pytest.warns(LightningHooksWarning, match=r"attention capture.*RuntimeError: injected"):
        trainer.fit(model)
    assert trainer.global_step == 2


def test_compiled_attention_is_left_out_with_a_warning() -> None:
    """Through the statistic alone (``Trainer.fit`` with a compiled block: test_compile.py)."""
    net = NanoGPT(4)
    net.h[1] = torch.compile(net.h[1], backend="aot_eager")  # type: ignore[assignment]
    ids = torch.randint(0, VOCAB, (2, LENGTH))
    with StabilityStats().attach(net) as stat:
        with pytest.warns(LightningHooksWarning, match=r"look like attention.*: h\.1\._orig_mod$"):
            net(ids).sum().backward()
            stat.end_step()
        tags = sorted(t for t in stat.tags(stat.result()) if "attn" in t)
    assert tags == ["stability/attn_entropy_min/h.0", "stability/attn_logit_max/h.0"]


def test_report_names_the_worst_attention_layer_by_logit_and_by_entropy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fit = _gpt2("sdpa")
    trainer = make_trainer(
        tmp_path, callbacks=[GradFlowCallback()], max_steps=STEPS, log_every_n_steps=EVERY
    )
    trainer.fit(fit)
    scalars = read_scalars(tmp_path)

    def worst(stat: str, pick: Callable[..., Any]) -> tuple[float, str]:
        tags = [t for t in scalars if t.startswith(f"stability/{stat}/")]
        tag = pick(tags, key=lambda t: scalars[t][-1][1])
        return scalars[tag][-1][1], tag.split("/", 2)[2]

    assert main(["report", str(tmp_path)]) == 0
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("attention: ")]
    (logit, at_logit), (entropy, at_entropy) = (
        worst("attn_logit_max", max),
        worst("attn_entropy_min", min),
    )
    assert line == (
        f"attention: largest logit {_fmt(logit)} at {at_logit}; "
        f"lowest entropy {_fmt(entropy)} at {at_entropy}"
    )


def test_dashboard_leads_the_stability_category_with_the_attention_charts(tmp_path: Path) -> None:
    trainer = make_trainer(
        tmp_path, callbacks=[GradFlowCallback()], max_steps=STEPS, log_every_n_steps=EVERY
    )
    trainer.fit(_nano(2))
    found = charts(read_layouts(tmp_path)[-1])
    stability = [t.split("/", 1)[1] for t in found if t.startswith("lightning_hooks: stability/")]
    assert stability[:4] == [
        "attn_logit_max",
        "attn_logit_max_step",
        "attn_entropy_min",
        "attn_entropy_min_step",
    ]
    tags = set(read_scalars(tmp_path))
    for chart in stability[:4]:
        regexes = found[f"lightning_hooks: stability/{chart}"]
        matched = {t for t in tags if any(re.match(r, t) for r in regexes)}
        assert matched == {f"stability/{chart}/net.h.{i}" for i in (0, 1)}


def _unchecked_nano() -> Fit:
    """The nanoGPT fit without the reference hooks (their ``.item()`` would count as syncs: the
    mode's frame is on their stack)."""
    return Fit(NanoGPT(2), _nano(2).loss, lambda *_: None, padded=False)


def test_through_fit_a_quiet_step_runs_the_bare_ops_and_no_step_syncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bare, hooked = OpsPerStep(), OpsPerStep()
    make_trainer(tmp_path / "bare", callbacks=[bare], max_steps=STEPS).fit(_unchecked_nano())
    with count_syncs(monkeypatch) as counter:

        def active(on: bool) -> Callable[[], None]:
            return lambda: setattr(counter, "active", on)

        window = StepWindow(active(True), active(False))
        callbacks = [window, hooked, GradFlowCallback(every_n_steps=2, alarms=False)]
        make_trainer(tmp_path / "hooked", callbacks=callbacks, max_steps=STEPS).fit(
            _unchecked_nano()
        )
    assert window.steps == STEPS and dict(counter.calls) == {}
    # every_n_steps=2 over steps 0-3: steps 0 (the epoch's first), 1 and 3 are logging steps.
    assert hooked.per_step[2] == bare.per_step[2]
    assert hooked.per_step[1] > bare.per_step[1]
    assert "stability/attn_entropy_min/net.h.1" in read_scalars(tmp_path / "hooked")


def test_other_hooks_calls_are_not_attention_even_when_they_call_modules() -> None:
    class Attend(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return functional.scaled_dot_product_attention(x, x, x)

    model = nn.Sequential(nn.Linear(4, 4), Attend())

    def softmax(*_: Any) -> None:
        torch.softmax(torch.randn(1, 2, 3, 3), -1)

    def call_then_softmax(module: nn.Module, args: Any) -> None:
        model[0](args[0])  # a module called from a hook ends: still inside the hook
        softmax()

    model[0].register_forward_hook(softmax)
    model[1].register_forward_pre_hook(call_then_softmax)
    seen: list[str] = []
    with HookRegistry(model) as registry:
        AttentionCapture(lambda name, _: seen.append(name)).attach(registry)
        model(torch.randn(2, 3, 4))
    assert seen == ["1"]


def test_a_softmax_counts_as_attention_only_in_a_module_named_as_attention() -> None:
    class SpatialSoftmax(nn.Module):  # a 4-D softmax over the width of a feature map
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(x, dim=-1)

    class EagerAttention(SpatialSoftmax):
        pass

    model = nn.Sequential(nn.Conv2d(3, 4, 1), SpatialSoftmax(), EagerAttention())
    seen: list[tuple[str, torch.Tensor]] = []
    with HookRegistry(model) as registry:
        AttentionCapture(lambda name, logits: seen.append((name, logits))).attach(registry)
        x = torch.randn(2, 3, 5, 6)
        y = model[1](model[0](x))
        model(x)
    assert [name for name, _ in seen] == ["2"]
    torch.testing.assert_close(seen[0][1], y)


def test_torch_nn_plain_layers_are_not_hooked_and_count_as_their_callers() -> None:
    """``torch.nn``'s own layers without submodules or hooks call no attention: the capture
    tracks none of them as callers (most of a model's modules), whatever hooks our statistics
    put there, and runs them outside its mode. A ``Softmax`` module's softmax then counts as
    its caller's, here an attention module's; a plain layer carrying a hook of the user's stays
    tracked, so an attention call made in that hook is still not taken; with a global forward
    hook every module is."""

    class EagerAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.softmax = nn.Linear(6, 6), nn.Softmax(dim=-1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.softmax(self.proj(x))

    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), EagerAttention(), nn.Linear(6, 6))
    model[3].register_forward_hook(lambda *_: functional.scaled_dot_product_attention(*[x] * 3))
    x = torch.randn(2, 3, 4, 6)
    seen: list[tuple[str, torch.Tensor]] = []
    with HookRegistry(model) as stats, HookRegistry(model) as registry:
        stats.forward_hook(model[0], lambda *_: None)  # another statistic's: not foreign
        AttentionCapture(lambda name, logits: seen.append((name, logits))).attach(registry)
        outside = {"suspend", "resume"}  # the hooks that take the mode off for a call
        named = [(registry._name(g.module), g.hook.__name__) for g in registry._gated_hooks]
        tracked = {module for module, hook in named if hook not in outside}
        suspended = {module for module, hook in named if hook in outside}
        model(x)
    assert tracked == {"Sequential", "2", "3"}  # the root, the attention, the layer with a hook
    assert suspended == {"0", "1", "2.proj"}  # outside the mode: the plain layers but the softmax
    assert [name for name, _ in seen] == ["2"]
    torch.testing.assert_close(seen[0][1], model[2].proj(model[1](model[0](x))))
    # a global forward hook runs in every layer: then every module is hooked
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *_: None)
    try:
        with HookRegistry(model) as registry:
            AttentionCapture(lambda *_: None).attach(registry)
            everything = {registry._name(g.module) for g in registry._gated_hooks}
    finally:
        handle.remove()
    assert len(everything) == len(list(model.modules()))


def test_a_sequential_of_plain_layers_runs_outside_the_mode_as_one_call() -> None:
    """An ``nn.Sequential`` whose modules are all plain layers (or such stacks) calls no
    attention: the capture takes its mode off for the whole stack (two hooks on the stack, none
    on its layers), while a stack holding an attention module, a ``Sequential`` subclass and a
    stack carrying a hook of the user's are tracked as before."""

    class Attend(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return functional.scaled_dot_product_attention(x, x, x)

    class Custom(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return functional.scaled_dot_product_attention(x, x, x) + super().forward(x)

    plain = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 4)))
    hooked = nn.Sequential(nn.Linear(4, 4))
    hooked.register_forward_hook(lambda *_: None)
    model = nn.Sequential(plain, nn.Sequential(nn.Tanh(), Attend()), Custom(nn.Tanh()), hooked)
    x = torch.randn(2, 3, 4)
    seen: list[tuple[str, torch.Tensor]] = []
    with HookRegistry(model) as stats, HookRegistry(model) as registry:
        inner = []  # another statistic's hook on a layer of the stack: runs outside the mode
        stats.forward_hook(plain[1][1], lambda *_: inner.append(torch.softmax(x[None], -1)))
        AttentionCapture(lambda name, logits: seen.append((name, logits))).attach(registry)
        named = [(registry._name(g.module), g.hook.__name__) for g in registry._gated_hooks]
        model(x)
    suspended = {module for module, hook in named if hook in {"suspend", "resume"}}
    tracked = {module for module, hook in named if hook not in {"suspend", "resume"}}
    assert suspended == {"0", "1.0", "2.0", "3.0"}  # the plain stack whole; the others' layers
    assert tracked == {"Sequential", "1", "1.1", "2", "3"}
    assert [name for name, _ in seen] == ["1.1", "2"] and len(inner) == 1
    y = torch.tanh(plain(x))
    torch.testing.assert_close(seen[0][1].reshape(2, 3, 3), y @ y.transpose(1, 2) / 2)


def test_logits_are_float32_under_autocast() -> None:
    q, k = (
        torch.randn(2, 2, 5, 8, dtype=torch.bfloat16),
        torch.randn(2, 2, 5, 8, dtype=torch.bfloat16),
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = sdpa_logits_whole(q, k, is_causal=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, sdpa_logits_whole(q, k, is_causal=True), rtol=0, atol=0)
