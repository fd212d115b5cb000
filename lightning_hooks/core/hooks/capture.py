"""Tools for plain PyTorch loops over a hooked model.

They record the outputs of named layers (:func:`capture_outputs`) and run a probe batch without
leaving a trace (:func:`probe_mode`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_hooks.core import checks
from lightning_hooks.core.hooks.registry import HookRegistry
from lightning_hooks.core.hooks.selection import Patterns, as_patterns

__all__ = ["capture_outputs", "probe_mode"]


def _apply(output: object, fn: Callable[[torch.Tensor], torch.Tensor]) -> object:
    """Return ``output`` with ``fn`` applied to each tensor in it (its containers rebuilt)."""
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, tuple) and hasattr(output, "_fields"):  # a namedtuple
        namedtuple: Callable[..., object] = type(output)  # built from its fields, by position
        return namedtuple(*(_apply(item, fn) for item in output))
    if isinstance(output, list | tuple):
        return type(output)(_apply(item, fn) for item in output)
    if isinstance(output, Mapping):
        return {key: _apply(item, fn) for key, item in output.items()}
    return output


def _keeper(
    name: str, store: dict[str, Any], detach: bool, clone: bool
) -> Callable[[nn.Module, tuple[Any, ...], object], None]:
    """Make a forward hook that stores the module's output in ``store[name]``.

    Args:
        name: the module's qualified name, the key in ``store``.
        store: the dict the outputs are recorded in.
        detach: store each tensor detached from the graph.
        clone: store a copy of each tensor.

    Returns:
        The forward hook.
    """

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach() if detach else tensor
        return tensor.clone() if clone else tensor

    def hook(module: nn.Module, args: tuple[Any, ...], output: object) -> None:
        store[name] = _apply(output, keep)

    return hook


@contextmanager
def capture_outputs(
    model: nn.Module, layers: Patterns, *, detach: bool = True, clone: bool = False
) -> Iterator[dict[str, Any]]:
    """Record the outputs of the named layers of ``model`` while the block runs.

    The hooks are removed on exit, also on an exception; the dict stays.

    Args:
        model: the model to record from.
        layers: qualified module names or glob patterns (``"layer4"``, ``"encoder.*"``).
        detach: store ``output.detach()`` (``False``: keep the graph, for a feature loss).
        clone: store a copy (an in-place op after the layer changes a detached output).

    Yields:
        A dict: each selected module's qualified name -> its output of the latest forward (any
        mode).

    Raises:
        ValueError: a name or pattern matches no module (the error lists the closest names), or
            ``layers`` names none.
        TypeError: ``model`` is not a ``torch.nn.Module``, or ``detach``/``clone`` is not a bool.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
        >>> with capture_outputs(model, ["0", "1"]) as features:
        ...     _ = model(torch.ones(2, 4))
        >>> sorted(features), features["1"].shape, features["1"].requires_grad
        (['0', '1'], torch.Size([2, 3]), False)
        >>> len(model[0]._forward_hooks)
        0
    """
    checks.module("capture_outputs", "model", model)
    detach = checks.boolean("capture_outputs", "detach", detach)
    clone = checks.boolean("capture_outputs", "clone", clone)
    patterns = as_patterns(layers, "capture_outputs(layers=...)")
    if not patterns:
        raise ValueError("capture_outputs(layers=...): expected at least one name, got none")
    store: dict[str, Any] = {}
    with HookRegistry(model) as hooks:
        for name, module in hooks.modules(include=patterns):
            hooks.forward_hook(module, _keeper(name, store, detach, clone))
        yield store


@contextmanager
def probe_mode(model: nn.Module) -> Iterator[None]:
    """Put ``model`` in eval mode under ``torch.no_grad()`` while the block runs.

    On exit (also after an exception) restore every ``training`` flag and the CPU and CUDA
    random states: a probe forward changes no BatchNorm statistic, keeps no graph, is skipped by
    the library's hooks and leaves the random stream.

    Args:
        model: the model the probe batch runs through.

    Yields:
        Nothing; the probe runs inside the block.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
        >>> model[1].eval()  # doctest: +ELLIPSIS
        Dropout(...)
        >>> state = torch.random.get_rng_state()
        >>> with probe_mode(model):
        ...     _ = model(torch.randn(3, 2))
        ...     model.training, torch.is_grad_enabled()
        (False, False)
        >>> model.training, model[1].training, torch.equal(state, torch.random.get_rng_state())
        (True, False, True)
    """
    checks.module("probe_mode", "model", model)
    modes = [(module, module.training) for module in model.modules()]
    cpu_state = torch.random.get_rng_state()
    initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    cuda_states = torch.cuda.get_rng_state_all() if initialized else None
    try:
        model.eval()
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training
        torch.random.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
