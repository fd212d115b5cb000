"""Every private attribute of torch, Lightning and TensorBoard the library touches.

It also names the releases the library supports.

This package is the one place where the library goes beyond the public APIs of the libraries it
builds on. Its entries are of two kinds:

- **Internals with no public path**, needed for correctness or to keep the quiet step free of
  host syncs and per-layer kernels. Each is named for what it does and says what would break
  without it. This module holds torch's; :mod:`.lightning` holds Lightning's.
- **Speed-ups with a public twin**: each says what it buys, measured with
  ``benchmarks/speedups.py``, and its public twin sits beside it. One switch turns them all
  off: ``LIGHTNING_HOOKS_SPEEDUPS=0`` (:func:`speedups`). :mod:`.lightning` holds the skipped
  empty hooks, :mod:`.tensorboard` the event files' checksums in C and a logging step's scalars
  in one event.

The oldest supported torch is :data:`OLDEST_TORCH` (see ``docs/install.md`` for the pairs of
torch and Lightning the test suite runs on). It is checked here, once, when the library is
imported: an older torch fails at import with a message that names both releases, never inside a
hook an epoch in. A new release that moves one of these names breaks this package alone.

This module imports torch only: the core, which knows nothing of Lightning or TensorBoard,
imports it. :mod:`.lightning` and :mod:`.tensorboard` are imported by the callbacks and the
logging layer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "CHANNEL_FIRST_LAYERS",
    "COMPILED_ORIGINAL",
    "OLDEST_TORCH",
    "SPEEDUPS_ENV",
    "TORCH_VERSION",
    "compiled_name",
    "compiled_original",
    "current_graph_task_id",
    "foreach_add_",
    "foreach_addcmul_",
    "foreach_copy_",
    "foreach_norm",
    "foreach_sub_",
    "foreach_zero_",
    "forward_hooks",
    "function_mode_at",
    "function_mode_depth",
    "global_forward_hooks_installed",
    "grad_scaler_scale",
    "is_compiled",
    "is_compiling",
    "pop_function_mode",
    "push_function_mode",
    "speedups",
    "steps_unscale_themselves",
    "tensor_version",
    "torch_version",
]

SPEEDUPS_ENV = "LIGHTNING_HOOKS_SPEEDUPS"
"""``0`` (or ``false``, ``no``, ``off``): every speed-up over a private attribute is off, and
the library takes each one's public twin."""


def speedups() -> bool:
    """Return whether the speed-ups over private attributes are on (the default).

    It is read where each speed-up is set up, at a fit's start or a logger's first write, never
    per step.

    Returns:
        ``False`` where :data:`SPEEDUPS_ENV` is ``0``, ``false``, ``no`` or ``off``, else ``True``.
    """
    return os.environ.get(SPEEDUPS_ENV, "").strip().lower() not in ("0", "false", "no", "off")


OLDEST_TORCH = (2, 4)
"""The oldest torch release the library supports. torch 2.3 and older lack what a logging step
uses: ``torch._foreach_norm(..., dtype=...)`` (the gradient norms of low-precision parameters
summed in float32 without a copy) from 2.4, and ``torch.compiler.is_compiling`` from 2.3."""


def torch_version(version: str) -> tuple[int, int]:
    """Return the ``(major, minor)`` release of a torch version string.

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


# --- Internals with no public path -------------------------------------------------------------
# Each is named for what it does, and says what would break without it. They are read here and
# nowhere else in the library (tests/test_internals.py checks that no other module names a
# private attribute of torch).


current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
"""The id of the backward autograd is running, ``-1`` outside one
(``torch._C._current_graph_task_id``). Without it, the forward that an activation checkpoint
recomputes during backward would be measured as a second training forward of the step."""


foreach_norm = torch._foreach_norm
"""``foreach_norm(tensors, ord=2, dtype=None)``: each tensor's norm in one multi-tensor pass
(``torch._foreach_norm``, bound once: the quiet step calls it directly). Without it, a norm is a
kernel per tensor, and the quiet step's few kernels become one per layer."""

foreach_add_ = torch._foreach_add_
"""``foreach_add_(tensors, other)``: in place, in one multi-tensor pass."""

foreach_addcmul_ = torch._foreach_addcmul_
"""``foreach_addcmul_(tensors, a, b)``: ``tensors[i] += a[i] * b[i]`` in one multi-tensor pass."""

foreach_copy_ = torch._foreach_copy_
"""``foreach_copy_(tensors, sources)``: in one multi-tensor pass (as :data:`foreach_norm`)."""

foreach_sub_ = torch._foreach_sub_
"""``foreach_sub_(tensors, others)``: in place, in one multi-tensor pass."""

foreach_zero_ = torch._foreach_zero_
"""``foreach_zero_(tensors)``: in one multi-tensor pass."""


# torch keeps no public view of its torch-function mode stack (``TorchFunctionMode`` only enters
# and exits). Without these four, the attention capture could not take its mode off for the
# library's own hooks and for ``torch.nn``'s plain layers, and each of their torch calls would
# cost a Python call of the mode on a logging step.

function_mode_depth: Callable[[], int] = torch._C._len_torch_function_stack
"""How many torch-function modes are on torch's stack: one C call, mostly 0."""

function_mode_at: Callable[[int], object] = torch._C._get_function_stack_at
"""The torch-function mode at an index of torch's stack (0: the outermost)."""

pop_function_mode: Callable[[], object] = torch._C._pop_torch_function_stack
"""Take the innermost torch-function mode off torch's stack, and return it."""

push_function_mode: Callable[[object], None] = torch._C._push_on_torch_function_stack
"""Put a mode on torch's torch-function mode stack, innermost."""


CHANNEL_FIRST_LAYERS: tuple[type[torch.nn.Module], ...] = (
    torch.nn.modules.conv._ConvNd,
    torch.nn.modules.batchnorm._BatchNorm,
)
"""The base classes of torch's convolutions and batch norms, whose outputs index their channels
by dimension 1. torch's public classes are one per dimension (``Conv1d`` to ``ConvTranspose3d``,
``BatchNorm1d`` to ``SyncBatchNorm``); without the bases, a subclass of the base that a library
defines would have its units counted along the wrong dimension."""


def forward_hooks(module: torch.nn.Module) -> list[Callable[..., Any]]:
    """Return the forward hooks and pre-hooks on ``module``, read from its own dicts of them.

    torch keeps no public view of them (a ``RemovableHandle`` only removes its hook). Without
    it, the attention capture could not tell a ``torch.nn`` layer that only the library hooks
    (run outside its mode as a whole) from one with a hook of the user's.

    Args:
        module: the layer whose hooks are read.

    Returns:
        Its forward hooks, then its forward pre-hooks.
    """
    return [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]


def global_forward_hooks_installed() -> bool:
    """Return whether any global module forward hook or pre-hook is registered.

    Global hooks are those of ``register_module_forward_hook`` and its pre-hook twin; they are
    read from torch's own dicts of them. torch keeps no public view of them. Without it, a
    ``torch.nn`` layer that a global hook watches could be run outside the attention capture's
    mode, and a user's global hook would see its calls outside the mode they expect.

    Returns:
        Whether any such hook is registered.
    """
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)


def is_compiled(model: torch.nn.Module) -> bool:
    """Return whether a module of ``model`` is compiled.

    Compiled means by ``torch.compile`` or by ``module.compile()``.

    torch keeps no public test of it: ``torch._dynamo``'s ``OptimizedModule`` wraps a compiled
    module, and ``module.compile()`` sets a private attribute. It is read only when
    ``torch._dynamo`` was imported already (nothing is compiled before), so that this check
    imports nothing. Without it, the library would put hooks on and off a compiled module at
    each logging step, and each change recompiles it.

    Args:
        model: the model whose modules (itself included) are checked.

    Returns:
        Whether ``model`` or any module under it is compiled.
    """
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(dynamo, "OptimizedModule", ())
    return any(
        isinstance(module, optimized)
        or getattr(module, "_compiled_call_impl", None) is not None
        or getattr(module, "_compiler_ctx", None) is not None
        for module in model.modules()
    )


def tensor_version(tensor: torch.Tensor) -> int:
    """Return how many times ``tensor`` was written in place (``tensor._version``).

    torch has no public name for its version counter. Without it, a copy of a layer's output that
    several statistics share could not tell an output changed in place (an in-place ReLU) from
    the one it copied.

    Args:
        tensor: the tensor whose version counter is read (a layer's output).

    Returns:
        Its version counter.
    """
    version: int = tensor._version
    return version


def compiled_original(module: torch.nn.Module) -> torch.nn.Module | None:
    """Return the module a ``torch.compile`` wrapper holds (its ``_orig_mod``).

    torch keeps no public name for it. Without it, a compiled submodule's layers would be named
    with ``_orig_mod`` in their tags, and a rename by compiling would break the tags' history.

    Args:
        module: a module that may be a ``torch.compile`` wrapper.

    Returns:
        The module it wraps, or ``None`` where ``module`` is no wrapper.
    """
    original = getattr(module, COMPILED_ORIGINAL, None)
    return original if isinstance(original, torch.nn.Module) else None


COMPILED_ORIGINAL = "_orig_mod"
"""The name a ``torch.compile`` wrapper gives the module it holds, also a part of the qualified
names of the modules under it (see :func:`compiled_original`)."""


def compiled_name(name: str) -> str:
    """Return a qualified module name without the parts a ``torch.compile`` wrapper adds.

    Args:
        name: a name of ``model.named_modules()``, maybe with ``_orig_mod`` parts.

    Returns:
        The name the module has in the eager model.

    Example:
        >>> compiled_name("encoder._orig_mod.0")
        'encoder.0'
    """
    return ".".join(part for part in name.split(".") if part != COMPILED_ORIGINAL)


def grad_scaler_scale(scaler: object) -> torch.Tensor | None:
    """Return the AMP ``GradScaler``'s scale as the device tensor it keeps (``scaler._scale``).

    The public ``get_scale()`` returns a Python float: a host sync at every fp16 step. Without
    this, the gradient statistics of a fused optimizer (whose gradients stay scaled) and the
    output gradients could not be divided by the scale without that sync.

    Args:
        scaler: the fit's ``GradScaler`` (any object: one without a tensor scale gives ``None``).

    Returns:
        The scale, or ``None`` before the scaler's first step.
    """
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None


def steps_unscale_themselves(optimizer: torch.optim.Optimizer) -> bool:
    """Return whether ``optimizer`` unscales AMP's gradients inside its own step.

    A fused optimizer says so with ``_step_supports_amp_scaling``: its gradients are still scaled
    before the step. torch keeps no public name for it. Without it, a fused Adam's gradient norms
    under fp16 would be logged multiplied by the scale.

    Args:
        optimizer: the optimizer whose step is checked.

    Returns:
        Whether its gradients are still scaled before its step.
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))
