"""The Triton kernels of :mod:`.pointer_norms`, imported only when used."""

import triton
import triton.language as tl

__all__ = ["norms", "partial_sums"]


@triton.jit  # type: ignore[untyped-decorator]
def partial_sums(  # type: ignore[no-untyped-def]  # noqa: PLR0913 (a Triton kernel takes each pointer and constant as an argument)
    ptrs, owner, begin, end, partial, block: tl.constexpr, kind: tl.constexpr
):
    """Sum the squares of one span of one tensor per program, in float32.

    ``partial[p]`` is the float32 sum of squares of the elements ``begin[p]:end[p]`` of the tensor
    ``owner[p]``, whose address is ``ptrs[owner[p]]`` and whose dtype is ``kind``'s (0: float32,
    1: bfloat16, 2: float16).

    Args:
        ptrs: the address of each tensor, written each step.
        owner: the tensor each span belongs to.
        begin: where each span begins in its tensor.
        end: where each span ends in its tensor.
        partial: the output, one float32 sum per span.
        block: the elements per load.
        kind: the tensors' dtype, as an index (0: float32, 1: bfloat16, 2: float16).
    """
    pid = tl.program_id(0)
    address = tl.load(ptrs + tl.load(owner + pid))
    if kind == 0:
        base = address.to(tl.pointer_type(tl.float32))
    elif kind == 1:
        base = address.to(tl.pointer_type(tl.bfloat16))
    else:
        base = address.to(tl.pointer_type(tl.float16))
    lo = tl.load(begin + pid)
    hi = tl.load(end + pid)
    acc = tl.zeros([block], tl.float32)
    for start in range(lo, hi, block):
        at = start + tl.arange(0, block)
        x = tl.load(base + at, mask=at < hi, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(partial + pid, tl.sum(acc, axis=0))


@triton.jit  # type: ignore[untyped-decorator]
def norms(partial, first, out, block: tl.constexpr, kind: tl.constexpr):  # type: ignore[no-untyped-def]
    """Add each tensor's partial sums in order and write the root, one tensor per program.

    ``out[t]`` is the root of tensor ``t``'s partial sums ``first[t]:first[t + 1]`` added in order,
    rounded to ``kind``'s dtype (as ``_foreach_norm`` returns it), as float32.

    Args:
        partial: the float32 sums of squares of every span, from :func:`partial_sums`.
        first: where each tensor's spans begin in ``partial``, with one entry past the last.
        out: the output, one float32 norm per tensor.
        block: the partial sums per load.
        kind: the tensors' dtype, as an index (0: float32, 1: bfloat16, 2: float16).
    """
    t = tl.program_id(0)
    lo = tl.load(first + t)
    hi = tl.load(first + t + 1)
    acc = tl.zeros([block], tl.float32)
    for start in range(lo, hi, block):
        at = start + tl.arange(0, block)
        acc += tl.load(partial + at, mask=at < hi, other=0.0)
    norm = tl.sqrt_rn(tl.sum(acc, axis=0))
    if kind == 1:
        norm = norm.to(tl.bfloat16).to(tl.float32)
    elif kind == 2:
        norm = norm.to(tl.float16).to(tl.float32)
    tl.store(out + t, norm)
