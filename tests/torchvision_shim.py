"""Lets PyPI's torchvision import beside the CPU torch wheel, for the timm tests.

PyPI's torchvision is a CUDA build: beside ``torch==2.13.0+cpu`` its C++ extension does not load,
so its operators (``torchvision::nms``, ``roi_align``, ...) are never registered. Its import then
fails in ``torchvision/_meta_registrations.py``: ``torch.library.register_fake("torchvision::nms")``
raises ``operator torchvision::nms does not exist`` (its own ``register_meta`` helper already
skips the missing operators; these two calls do not). The shim makes ``register_fake`` skip a
``torchvision::`` operator exactly when torchvision reports that its operators did not load.

Why it is safe: a fake kernel only tells ``torch.compile`` / FakeTensor the output shape of its
operator; an operator that does not exist in the process can never be called, so no kernel is
lost. Every other ``register_fake`` call is passed through unchanged. timm's models (the ViT
here) call no torchvision operator. Imported by ``conftest.py`` before anything imports
torchmetrics (which imports torchvision when it is installed).
"""

from __future__ import annotations

import sys
from typing import Any

import torch.library

__all__ = ["register_fake"]

_real_register_fake = torch.library.register_fake


def _missing_torchvision_op(op: Any) -> bool:
    extension = sys.modules.get("torchvision.extension")
    return (
        isinstance(op, str)
        and op.startswith("torchvision::")
        and extension is not None
        and not extension._has_ops()
    )


def register_fake(op: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch.library.register_fake``, a no-op for a torchvision operator that did not load."""
    if _missing_torchvision_op(op):
        return args[0] if args else (lambda fn: fn)
    return _real_register_fake(op, *args, **kwargs)


torch.library.register_fake = register_fake
