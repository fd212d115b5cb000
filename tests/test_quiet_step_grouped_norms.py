"""The quiet step's grouped read (``AlarmRules(quiet_read="grouped")``, the default) against
``torch._foreach_norm``: the same norms, bit for bit, in parameter order."""

from __future__ import annotations

import pytest
import torch
from ops import OpCounter

from lightning_hooks.core.ops.grouped_norms import MAX_GROUPS, SMALL, GroupedNorms

SHAPES = [(64, 64), (64,), (64,), (10, 64), (64, 64), (64,), (3, 4, 5), (3, 4, 5), (3, 4, 5)]
SHAPES += [(SMALL + 1,), (SMALL + 1,), (SMALL + 1,), (7,), (0,), (0,), (), (), (), (2, 3)]


def _grads(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(s, generator=gen) * 10.0 ** (i % 5 - 2)).to(dtype)
        for i, s in enumerate(SHAPES)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_norms_are_foreach_norms_bit_for_bit(dtype: torch.dtype) -> None:
    grads = _grads(dtype)
    read = GroupedNorms(grads)
    assert read.groups == [[1, 2, 5], [6, 7, 8]]  # two of (64, 64): one op each
    expected = torch.stack(torch._foreach_norm(grads))
    for seed in range(3):  # the same read on new gradients each step
        grads = _grads(dtype, seed)
        expected = torch.stack(torch._foreach_norm(grads))
        got = read(grads)
        assert got.dtype == expected.dtype and torch.equal(got, expected), (got, expected)


def test_large_empty_and_scalar_gradients_are_read_by_foreach() -> None:
    read = GroupedNorms(_grads(torch.float32))
    grouped = {i for g in read.groups for i in g}
    assert {i for i, s in enumerate(SHAPES) if s == (SMALL + 1,) or 0 in s or s == ()} <= set(
        read.rest
    )
    assert sorted(grouped | set(read.rest)) == list(range(len(SHAPES)))


def test_nan_and_inf_reach_their_own_row_only() -> None:
    grads = _grads(torch.float32)
    grads[2] = grads[2].clone()
    grads[2][5] = float("nan")
    grads[7] = grads[7].clone()
    grads[7][0, 0, 0] = float("inf")
    got = GroupedNorms(grads)(grads)
    assert got[2].isnan() and got[7].isinf()
    assert got[[i for i in range(len(grads)) if i not in (2, 7)]].isfinite().all()


def test_at_most_max_groups_stacks_the_largest_sets() -> None:
    params = [torch.zeros(n) for n in range(1, MAX_GROUPS + 3) for _ in range(n + 1)]
    read = GroupedNorms(params)
    assert len(read.groups) == MAX_GROUPS
    assert [len(g) for g in read.groups] == list(range(MAX_GROUPS + 3, 3, -1))
    assert torch.equal(read(params), torch.stack(torch._foreach_norm(params)))


@pytest.mark.parametrize("rest", [0, 1, 2])
def test_any_number_of_gradients_outside_the_stacks(rest: int) -> None:
    grads = [torch.randn(5) for _ in range(3)] + [torch.randn(6 + i) for i in range(rest)]
    read = GroupedNorms(grads)
    assert read.groups == [[0, 1, 2]] and len(read.rest) == rest
    assert torch.equal(read(grads), torch.stack(torch._foreach_norm(grads)))


def test_without_a_set_of_three_it_is_one_foreach_norm() -> None:
    grads = [torch.randn(3), torch.randn(3), torch.randn(4)]
    read = GroupedNorms(grads)
    assert read.groups == [] and read.rest == [0, 1, 2]
    assert torch.equal(read(grads), torch.stack(torch._foreach_norm(grads)))


def test_mixed_dtypes_are_promoted_as_foreach_norms_stack_is() -> None:
    grads = [torch.randn(4).bfloat16() for _ in range(3)] + [torch.randn(3) for _ in range(3)]
    grads.append(torch.randn(5, dtype=torch.float64))
    read = GroupedNorms(grads)
    assert read.groups == [[0, 1, 2], [3, 4, 5]]
    got, want = read(grads), torch.stack(torch._foreach_norm(grads))
    assert got.dtype == want.dtype == torch.float64 and torch.equal(got, want)


def test_a_read_is_at_most_two_ops_per_stack_and_four_more() -> None:
    """The bound ``tests/test_cost.py`` and the docs give: at most ``2 * MAX_GROUPS + 4`` ATen
    ops per read (a stack and a norm per stack, a ``_foreach_norm`` and a stack for the rest, a
    cat and an index), whatever the number of tensors; 2 when nothing is stacked."""
    many = [torch.randn(n) for n in range(1, MAX_GROUPS + 4) for _ in range(40)]
    many += [torch.randn(SMALL + 1) for _ in range(30)]
    for grads, ops in ((many, 2 * MAX_GROUPS + 4), ([torch.randn(3), torch.randn(4)], 2)):
        read = GroupedNorms(grads)
        counter = OpCounter()
        with counter:
            read(grads)
        assert counter.total == ops, counter.ops
