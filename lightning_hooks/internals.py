"""The torch releases this library supports, and what it needs of torch that is checked there.

The oldest supported torch is :data:`OLDEST_TORCH` (see ``docs/install.md`` for the pairs of
torch and Lightning the test suite runs on). The check is made here, once, when the library is
imported: an older torch fails at import with a message that names both releases, never inside a
hook an epoch in. A check of torch's behaviour that a hook needs is made here too, so that hooks
never ask which torch they run on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["OLDEST_TORCH", "TORCH_VERSION", "is_compiling", "torch_version"]

OLDEST_TORCH = (2, 4)
"""The oldest torch release the library supports. torch 2.3 and older lack what a logging step
uses: ``torch._foreach_norm(..., dtype=...)`` (the gradient norms of low-precision parameters
summed in float32 without a copy) from 2.4, and ``torch.compiler.is_compiling`` from 2.3."""


def torch_version(version: str) -> tuple[int, int]:
    """The ``(major, minor)`` release of a torch version string.

    Args:
        version: a version as ``torch.__version__`` gives it, local part and all.

    Returns:
        Its major and minor release numbers.

    Example:
        >>> torch_version("2.4.1+cpu")
        (2, 4)
    """
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION = torch_version(torch.__version__)
"""The running torch's ``(major, minor)`` release."""

if TORCH_VERSION < OLDEST_TORCH:
    _OLDEST = f"{OLDEST_TORCH[0]}.{OLDEST_TORCH[1]}"
    raise ImportError(
        f"lightning_hooks needs torch {_OLDEST} or newer; this is torch {torch.__version__}: "
        f"upgrade torch (pip install 'torch>={_OLDEST}')."
    )

is_compiling: Callable[[], bool] = torch.compiler.is_compiling
"""Whether the caller runs inside a region ``torch.compile`` is tracing (``False`` in eager
code): the one compile check of the library's hooks, called as ``internals.is_compiling()``.

Example:
    >>> is_compiling()
    False
"""
