"""Run a model on a probe batch without leaving a trace: eval mode, no grad, RNG restored."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["probe_mode"]


@contextmanager
def probe_mode(model: nn.Module) -> Iterator[None]:
    """Put ``model`` in eval mode under ``torch.no_grad()`` and undo everything on exit.

    On exit, also after an exception, every submodule gets back its own ``training`` flag (a
    model partly in eval mode stays so) and the random number generators get back their state:
    the torch CPU generator, and every CUDA device's generator once CUDA is initialized. So a
    probe forward changes no BatchNorm running statistic (eval mode), keeps no autograd graph,
    is ignored by the library's forward hooks (they count grad-enabled forwards only) and does not
    shift the random stream that training draws from.

    Example:
        >>> from torch import nn
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
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"probe_mode(model={model!r}): must be an nn.Module, got {type(model).__name__}"
        )
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
