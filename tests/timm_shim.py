"""Import timm on a CPU-only torch whose matching torchvision is PyPI's CUDA build.

``./dev`` installs timm and torchvision into ``.venv/extras/timm``, a folder that only this
module puts on ``sys.path`` (last, so a timm installed as usual wins): torchmetrics, and through
it Lightning, imports torchvision whenever it is installed, and a torchvision that fails to
import would break every other import of the library.

PyPI's torchvision wheel (a CUDA build) cannot load its compiled operators beside the CPU torch
of the project machines, and its ``import`` then fails in ``torchvision._meta_registrations``,
which registers fake (meta) kernels for those operators: ``RuntimeError: operator
torchvision::nms does not exist``. Only that module fails; the rest of torchvision is Python.

Why skipping it is safe for our tests: the fake kernels are used only when one of those
compiled operators (``nms``, ``roi_align``, ``roi_pool``, ``ps_roi_*``, ``deform_conv2d``) is
traced under ``torch.compile`` or a fake tensor; none of them is called by timm's model code
(ViT, ResNet: convolutions, attention, normalization, from torch itself), and a call would
fail loudly (the operator does not exist), never compute a wrong value. Where torchvision
imports as it is (a GPU machine, a matching CPU build), nothing is stubbed.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

__all__ = ["import_timm"]

_META = "torchvision._meta_registrations"
EXTRAS = Path(__file__).resolve().parents[1] / ".venv" / "extras" / "timm"


def import_timm() -> Any:
    """``timm``, importing torchvision without its fake-kernel registrations if it must."""
    if EXTRAS.is_dir() and str(EXTRAS) not in sys.path:
        sys.path.append(str(EXTRAS))
    try:
        import torchvision
    except RuntimeError as err:
        if "torchvision::" not in str(err):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]  # the half-imported package, before the retry
        sys.modules[_META] = types.ModuleType(_META, "skipped: see tests/timm_shim.py")
        import torchvision  # noqa: F401
    import timm

    return timm
