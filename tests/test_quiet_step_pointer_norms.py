"""The pointer-table norms of ``AlarmRules(quiet_read="triton")`` against ``_foreach_norm``.

Needs Triton (PyTorch's CUDA wheels ship it) and CUDA; skipped otherwise, as on the CPU CI.
Without CUDA the kernels run in Triton's interpreter, which follows the table's addresses into
host memory, when the process starts with ``TRITON_INTERPRET=1`` (Triton reads it at its
import, which Lightning makes before any test module runs)::

    # Triton installed, no GPU
    TRITON_INTERPRET=1 python -m pytest tests/test_quiet_step_pointer_norms.py
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA, or Triton's interpreter (TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from lightning_hooks.core.ops.pointer_norms import SPAN, PointerNorms  # noqa: E402

SIZES = [(0,), (1,), (7, 13), (SPAN - 1,), (SPAN,), (SPAN + 1,), (3, SPAN + 5)]


def _params(dtype: torch.dtype, scale: float = 1.0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter((torch.randn(s, generator=g) * scale).to(DEVICE, dtype)) for s in SIZES
    ]


def _grads(params: list[torch.nn.Parameter], scale: float = 1.0) -> list[torch.Tensor]:
    return [torch.randn_like(p) * scale for p in params]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norms_equal_foreach_norm_and_repeat_bit_for_bit(dtype: torch.dtype) -> None:
    params = _params(dtype)
    read = PointerNorms(params)
    for _ in range(2):  # new gradients at new addresses, as each backward makes them
        grads = _grads(params)
        got = read(grads)
        assert got is not None and got.dtype == torch.float32
        want = torch.stack(torch._foreach_norm(grads)).float()
        # float32 sums in another order: a norm rounded to bf16 / fp16 (as foreach's is) may
        # land one unit in the last place away
        tol = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
        torch.testing.assert_close(got, want, rtol=tol, atol=0)
        assert torch.equal(got.to(dtype).float(), got)  # rounded to the gradients' dtype
        assert got[0] == 0  # an empty gradient's norm
        again = read(grads).clone()  # type: ignore[union-attr]
        assert torch.equal(again, got)


def test_nonfinite_gradients_give_nonfinite_norms() -> None:
    params = _params(torch.float32)
    grads = _grads(params)
    grads[2][3, 4] = float("nan")
    grads[5][-1] = float("inf")
    grads[6][0, 0] = 1e30  # its square overflows float32, as in _foreach_norm
    with warnings.catch_warnings():  # Triton's interpreter squares in numpy, which says so
        warnings.simplefilter("ignore", RuntimeWarning)
        got = PointerNorms(params)(grads)
    assert got is not None
    want = torch.stack(torch._foreach_norm(grads)).float()
    assert torch.isnan(got[2]) and torch.isinf(got[5]) and torch.isinf(got[6])
    assert torch.isinf(want[6])
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=0)


def test_a_gradient_that_is_not_contiguous_is_read_with_foreach_norm() -> None:
    params = _params(torch.float32)
    grads = _grads(params)
    grads[2] = torch.randn(13, 7, device=DEVICE).t()
    want = torch.stack(torch._foreach_norm(grads))
    assert torch.equal(PointerNorms(params)(grads), want)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ([torch.zeros(2), torch.zeros(2, dtype=torch.float64)], "one dtype"),
        ([torch.zeros(2, dtype=torch.float64)], "one dtype"),
        ([torch.zeros(3, 4).t()], "contiguous"),
    ],
)
def test_layouts_it_cannot_read_are_refused(params: list[torch.Tensor], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PointerNorms(params)
