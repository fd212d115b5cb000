"""The on-device accumulator and the pure gradient statistics against plain torch."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hooks.core import GradFlowTracker, LayerStatsAccumulator, ParamLayout, grad_stats
from lightning_hooks.core.ops import grouped_norms as kernels
from lightning_hooks.core.ops.feature_stats import feature_stats
from lightning_hooks.core.ops.grad_stats import update_norms
from lightning_hooks.core.ops.grouped_norms import CHUNK, abs_sum_max
from lightning_hooks.core.ops.tensors import (
    DEVICE_PIECE,
    LOGSUMEXP_PIECE,
    Workspace,
    logsumexp_rows,
)


def test_accumulator_mean_peak_total_count_with_rows_columns_and_mask() -> None:
    acc = LayerStatsAccumulator(["a", "b", "c"], ["x", "y"])
    acc.update(torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]]))
    acc.update(torch.tensor([[5.0], [7.0]]), [1], rows=torch.tensor([0, 2]))
    acc.update(
        torch.tensor([[100.0], [9.0]]),
        [0],
        rows=torch.tensor([1, 2]),
        valid=torch.tensor([[False], [True]]),
    )
    r = acc.result()
    assert r.count.tolist() == [[1, 2], [1, 1], [2, 2]]
    assert r.total.tolist() == [[1, 15], [2, 20], [12, 37]]
    assert r.peak.tolist() == [[1, 10], [2, 20], [9, 30]]
    assert r.mean.tolist() == [[1, 7.5], [2, 20], [6, 18.5]]
    acc.reset()
    assert math.isnan(acc.result().mean[0, 0])


def test_nan_propagates_to_mean_and_peak() -> None:
    acc = LayerStatsAccumulator(["a"], ["x"])
    acc.update(torch.tensor([[1.0]]))
    acc.update(torch.tensor([[float("nan")]]))
    r = acc.result()
    assert math.isnan(r.mean[0, 0]) and math.isnan(r.peak[0, 0])


def test_grad_stats_match_plain_torch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.LayerNorm(3))
    model(torch.randn(11, 5)).pow(3).sum().backward()
    layout = ParamLayout.from_modules(list(model.named_children()))
    grads = [p.grad for p in layout.params]
    grads[1][2] = float("inf")  # one non-finite entry in layer "0"
    stats = grad_stats(grads, layout.params, layout.layer_index)  # type: ignore[arg-type]
    for row, name in enumerate(layout.layers):
        module = dict(model.named_children())[name]
        g = torch.cat([p.grad.flatten() for p in module.parameters()])  # type: ignore[union-attr]
        w = torch.cat([p.flatten() for p in module.parameters()])
        finite = row != 0
        if finite:
            torch.testing.assert_close(stats[row, 0], g.norm())
            torch.testing.assert_close(stats[row, 1], g.abs().mean())
            torch.testing.assert_close(stats[row, 2], g.abs().max())
        assert stats[row, 3] == (~g.isfinite()).sum()
        torch.testing.assert_close(stats[row, 4], w.norm())
    assert stats[-1, 3] == 1 and math.isinf(stats[-1, 0])


def test_abs_sum_max_pieces_large_tensors_and_keeps_nan() -> None:
    # A tensor over CHUNK elements goes through the reused buffer in pieces (the last one
    # short); small, empty, half-precision and NaN-holding tensors alongside.
    g = torch.Generator().manual_seed(0)
    large = torch.randn(2 * CHUNK + 5, generator=g)
    large[CHUNK + 3] = -7.0  # the maximum sits in the middle piece
    small = [torch.randn(3, 4, generator=g), torch.empty(0), torch.randn(9).half()]
    small += [torch.randn(7, generator=g).bfloat16(), torch.randn(5, generator=g).double()]
    tensors = [large, *small, torch.tensor([1.0, math.nan])]
    sums, peaks = abs_sum_max(tensors)
    assert sums.dtype == peaks.dtype == torch.float32
    for t, s, m in zip(tensors[:-1], sums[:-1], peaks[:-1], strict=True):
        ref = t.double().abs()
        torch.testing.assert_close(s, ref.sum().float(), rtol=1e-5, atol=0.0)
        assert m == (ref.max().float() if t.numel() else 0.0)
    assert sums[-1].isnan() and peaks[-1].isnan()  # a small tensor's NaN too
    large[2 * CHUNK + 1] = torch.nan  # in the short last piece
    sums, peaks = abs_sum_max([large])
    assert sums.isnan().all() and peaks.isnan().all()


def test_update_norms_match_plain_torch() -> None:
    layout = ParamLayout.from_modules([("a", nn.Linear(3, 2)), ("b", nn.Linear(2, 2))])
    before = [p.detach().clone() for p in layout.params]
    after = [p + 0.5 * torch.randn_like(p) for p in before]
    expected = [
        torch.cat(
            [
                (a - b).flatten()
                for a, b, i in zip(after, before, layout.owner, strict=True)
                if i == k
            ]
        )
        for k in (0, 1)
    ]
    norms = update_norms([b.clone() for b in before], after, layout.layer_index)
    torch.testing.assert_close(norms[:2], torch.stack([e.norm() for e in expected]))
    torch.testing.assert_close(norms[2], torch.cat(expected).norm())


def test_tracker_with_two_optimizers_measures_each_layer_once_per_step() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model[2].parameters(), lr=0.1)
    with GradFlowTracker(model, [opt_a, opt_b]) as tracker:
        for _ in range(2):
            model(torch.randn(4, 3)).sum().backward()
            for opt in (opt_a, opt_b):
                tracker.observe(opt)
                opt.step()
                opt.zero_grad()
        counts = tracker.result().count
    assert counts[0].tolist() == [2] * 7 + [0] and counts[1].tolist() == [2] * 7 + [0]
    assert counts[2, 0] == 4  # the global row is observed at every optimizer step


def test_tracker_output_grad_norm_matches_retain_grad_with_inplace_relu() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 2))
    twin = copy.deepcopy(model)
    twin[1] = nn.ReLU()  # the reference keeps the pre-activation tensor intact
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    expected = []
    with GradFlowTracker(model, [opt]) as tracker:
        for _ in range(3):
            x = torch.randn(5, 4)
            model(x).pow(2).sum().backward()
            hidden = twin[0](x)
            hidden.retain_grad()
            out = twin[2](twin[1](hidden))
            out.retain_grad()
            out.pow(2).sum().backward()
            expected.append((hidden.grad.norm(), out.grad.norm()))  # type: ignore[union-attr]
            tracker.observe(opt)
            for o in (opt, twin_opt):
                o.step()
                o.zero_grad()
        stats = tracker.result()
    col = stats.stats.index("output_grad_norm")
    for row in (0, 1):
        values = torch.stack([e[row] for e in expected])
        assert math.isclose(stats.mean[row, col], values.mean().item(), rel_tol=1e-5)
        assert math.isclose(stats.peak[row, col], values.max().item(), rel_tol=1e-5)


def _ops(fn: Any, n: int, device: str) -> int:
    from ops import OpCounter

    x = torch.ones(n, device=device, dtype=torch.bfloat16)
    counter = OpCounter()
    counter.start()
    fn(x)
    counter.stop()
    return counter.total


@pytest.mark.parametrize(
    "fn",
    [feature_stats, lambda x: abs_sum_max([x])],
    ids=["feature_stats", "abs_sum_max"],
)
def test_off_the_cpu_a_large_tensor_is_read_in_one_piece_not_in_cache_sized_ones(fn: Any) -> None:
    # A GPU's cost is launches: ResNet-50's 51M-element activations in 2**19-element pieces
    # were 60,000 kernels and 970 ms on an H200's logging step. The meta device stands in for
    # any accelerator: the same code path, no data.
    small, large = CHUNK + 1, 8 * CHUNK
    assert _ops(fn, large, "meta") == _ops(fn, small, "meta")
    assert _ops(fn, DEVICE_PIECE + 1, "meta") > _ops(fn, DEVICE_PIECE, "meta")  # two pieces
    assert _ops(fn, large, "cpu") > _ops(fn, small, "cpu")  # the CPU keeps its cache pieces


class _Largest(TorchDispatchMode):
    """The most elements of any float32 tensor an operation returned while it was active (the
    copies and temporaries; the views of a bf16 input are not memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.most = max(self.most, t.numel())
        return out


def test_the_log_partition_of_large_logits_makes_no_float32_copy_of_them() -> None:
    # The output layer's log Z on a logging step: an LM head's bf16 logits (GPT-2 124M: 411M
    # entries) were copied whole to float32, with logsumexp's temporaries as large, every time.
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 40, 5000, generator=g) * 8).to(torch.bfloat16)  # 1.2M > a piece
    with _Largest() as largest:
        logz = logsumexp_rows(logits)
    assert torch.equal(logz, torch.logsumexp(logits.float(), dim=-1))
    assert logz.shape == (6, 40) and logz.dtype == torch.float32
    assert largest.most <= LOGSUMEXP_PIECE < logits.numel()
    assert logsumexp_rows(torch.tensor([1.0, 2.0])).shape == ()  # a 1-d output: one row


@pytest.mark.parametrize("grouped", [True, False], ids=["cpu-stacks", "multi-tensor"])
def test_small_tensors_take_a_constant_few_ops_whatever_their_number(
    grouped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A logging step's ``|g|`` sums and maxima of small gradients take the same few ATen ops
    for 10 tensors as for 200 (a GPU's cost is launches; a sum per tensor was 100 ops for 96
    tensors). On the CPU, tensors of one shape are stacked and reduced along the rows (stack,
    ``abs_``, sum, max, and a cat and an index per result); elsewhere, as on the CPU without a
    stack, they take two multi-tensor norms and their stacks."""
    from ops import OpCounter

    if not grouped:
        monkeypatch.setattr(kernels, "cpu_grouping", lambda tensors, workspace: None)

    def count(n: int) -> int:
        tensors = [torch.randn(64) for _ in range(n)]
        workspace = Workspace()
        abs_sum_max(tensors, workspace)  # the first read makes the stacks
        counter = OpCounter()
        counter.start()
        abs_sum_max(tensors, workspace)
        counter.stop()
        return counter.total

    assert count(10) == count(200) <= (10 if grouped else 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_stacked_abs_sums_and_maxima_are_those_of_each_tensor(dtype: torch.dtype) -> None:
    """The CPU's stacks give each tensor's own ``|t|`` sum and maximum, NaN and Inf in their own
    row only, in the order given, with the tensors too large or alone to stack among them."""
    g = torch.Generator().manual_seed(3)
    shapes = [(8, 5), (7,), (8, 5), (7,), (8, 5), (7,), (20000,), (3, 3), (7,)]
    tensors = [(torch.randn(s, generator=g) * 100).to(dtype) for s in shapes]
    tensors[2][1, 1], tensors[5][0] = torch.nan, -torch.inf
    workspace = Workspace()
    assert kernels.cpu_grouping(tensors, workspace) is not None
    sums, peaks = abs_sum_max(tensors, workspace)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    for i, t in enumerate(tensors):
        expected_sum = t.to(wide).abs().sum().float()
        torch.testing.assert_close(sums[i], expected_sum, equal_nan=True, rtol=1e-6, atol=0)
        assert torch.equal(peaks[i], t.abs().max().float()) or (peaks[i].isnan() and i == 2)
    assert sums.dtype == peaks.dtype == torch.float32
    assert sums[[0, 1, 3, 4, 6, 7, 8]].isfinite().all() and peaks[5].isinf()


def test_noted_output_gradient_norms_sum_into_their_rows_once_each() -> None:
    """The eager output-gradient hooks note ``(row, norm)`` and the record sums the squares in
    one multi-tensor op per round of distinct rows: a row noted three times (a module called
    thrice, or three backward passes) gets all three, as one ``addcmul_`` per note would."""
    from ops import OpCounter

    from lightning_hooks.core.stats.output_grad import _NotedNorm, _sum_noted

    sq, expected = torch.zeros(4), torch.zeros(4)
    rows = [sq.select(0, i) for i in range(4)]
    picks = [0, 2, 0, 3, 0, 2]
    norms = [torch.tensor(float(k + 1)) for k in range(len(picks))]
    noted = [_NotedNorm(rows[i], n) for i, n in zip(picks, norms, strict=True)]
    for i, n in zip(picks, norms, strict=True):
        expected[i] += n * n
    hit = torch.zeros(4)
    hit_rows = [hit.select(0, i) for i in range(4)]  # one view per row, as the hooks hold
    hits = [hit_rows[i] for i in picks]
    counter = OpCounter()
    counter.start()
    _sum_noted(noted, hits)
    counter.stop()
    assert noted == hits == [] and sq.tolist() == expected.tolist() == [35.0, 0.0, 40.0, 16.0]
    assert hit.tolist() == [3.0, 0.0, 2.0, 1.0]
    # rounds of distinct rows: {0, 2, 3}, {0, 2}, {0}; for the norms and for the hits
    assert counter.ops == {"_foreach_addcmul_": 3, "_foreach_add_": 3}


def _typical_update_one_by_one(
    before: list[torch.Tensor], after: list[torch.Tensor], grads: list[Any] | None
) -> torch.Tensor:
    """``typical_update`` as it was written before its stacks: one tensor at a time."""
    picks = []
    for i, (old, new) in enumerate(zip(before, after, strict=True)):
        stride = max(1, new.numel() // 1024)
        pick = torch.sub(new.flatten()[::stride], old.flatten()[::stride]).float().abs_()
        grad = None if grads is None else grads[i]
        if grad is not None:
            pick = pick.masked_fill_(grad.flatten()[::stride] == 0, torch.nan)
        elif grads is not None:
            pick = pick.fill_(torch.nan)
        picks.append(pick)
    return torch.cat(picks).nanmedian()


@pytest.mark.parametrize("masked", ["none", "some zero", "some missing"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_typical_update_read_in_stacks_is_the_one_read_tensor_by_tensor(
    dtype: torch.dtype, masked: str
) -> None:
    """Small tensors of one shape are read in a stack (their strided sample, their gradients'
    zeros): the median is the one read tensor by tensor, whatever the order of the reads."""
    from lightning_hooks.core.ops.grouped_norms import typical_update

    g = torch.Generator().manual_seed(7)
    shapes = [(64, 64), (64,), (64, 64), (64,), (3,), (9000,), (64,), (2, 5000), (64, 64), (1,)]
    before = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    after = [
        (b.float() + torch.randn(b.shape, generator=g) * (i + 1)).to(dtype)
        for i, b in enumerate(before)
    ]
    grads: list[Any] | None = None
    if masked != "none":
        grads = [torch.randn(s, generator=g).to(dtype) for s in shapes]
        for grad in grads[::2]:
            grad.view(-1)[::3] = 0.0  # dead entries: out of the median
        if masked == "some missing":
            grads[1] = grads[4] = grads[8] = None  # did not take part
    got = typical_update(before, after, grads)
    want = _typical_update_one_by_one(before, after, grads)
    assert torch.equal(got, want), (got, want)
