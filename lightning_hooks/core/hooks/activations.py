"""What an activation module computes, for the activation classes of Hugging Face and timm.

Their activation modules (``NewGELUActivation``, ``timm.layers.GELU``, ...) do not subclass
``nn.GELU``, so ``isinstance`` misses them. :data:`KNOWN_ACTIVATIONS` maps each, by defining
module and class name (nothing is imported), to the torch class that computes the same function
or family (a GELU approximation is a GELU), so ``types=nn.GELU`` selects every GELU.
``tests/test_third_party.py`` checks each entry against what the class computes.
"""

from __future__ import annotations

import weakref

from torch import nn

__all__ = ["KNOWN_ACTIVATIONS", "is_kind", "torch_equivalent"]

_HF = ("transformers.activations",)
_TIMM = (
    "timm.layers.activations",
    "timm.layers.activations_me",
    "timm.models.layers.activations",  # timm < 0.9
    "timm.models.layers.activations_me",
)

_HF_CLASSES: dict[str, type[nn.Module]] = {
    "GELUActivation": nn.GELU,
    "NewGELUActivation": nn.GELU,
    "FastGELUActivation": nn.GELU,
    "QuickGELUActivation": nn.GELU,
    "GELUTanh": nn.GELU,
    "PytorchGELUTanh": nn.GELU,
    "ClippedGELUActivation": nn.GELU,
    "AccurateGELUActivation": nn.GELU,
    "SiLUActivation": nn.SiLU,
    "MishActivation": nn.Mish,
    "ReLUSquaredActivation": nn.ReLU,
    "LaplaceActivation": nn.Sigmoid,
    "SqrtSoftplusActivation": nn.Softplus,
}
_TIMM_CLASSES: dict[str, type[nn.Module]] = {
    "GELU": nn.GELU,
    "GELUTanh": nn.GELU,
    "QuickGELU": nn.GELU,
    "Swish": nn.SiLU,
    "SwishMe": nn.SiLU,
    "Mish": nn.Mish,
    "MishMe": nn.Mish,
    "HardMish": nn.Mish,
    "HardMishMe": nn.Mish,
    "Sigmoid": nn.Sigmoid,
    "Tanh": nn.Tanh,
    "HardSwish": nn.Hardswish,
    "HardSwishMe": nn.Hardswish,
    "HardSigmoid": nn.Hardsigmoid,
    "HardSigmoidMe": nn.Hardsigmoid,
}

KNOWN_ACTIVATIONS: dict[tuple[str, str], type[nn.Module]] = {
    **{(m, c): t for m in _HF for c, t in _HF_CLASSES.items()},
    **{(m, c): t for m in _TIMM for c, t in _TIMM_CLASSES.items()},
}
"""``(defining module, class name)`` of a third-party activation class -> the torch class that
computes the same function or family."""


_SEEN: weakref.WeakKeyDictionary[type, type[nn.Module] | None] = weakref.WeakKeyDictionary()


def _equivalent(cls: type) -> type[nn.Module] | None:
    # Looked up once per class: a selection runs it for every module of the model.
    if cls in _SEEN:
        return _SEEN[cls]
    found = next(
        (
            KNOWN_ACTIVATIONS[key]
            for key in ((base.__module__, base.__name__) for base in cls.__mro__)
            if key in KNOWN_ACTIVATIONS
        ),
        None,
    )
    _SEEN[cls] = found
    return found


def torch_equivalent(module: nn.Module) -> type[nn.Module]:
    """The torch class ``module`` computes as: its own class, or the registry's for a known
    third-party activation (a subclass of one counts as it).

    Example:
        >>> torch_equivalent(nn.ReLU()).__name__
        'ReLU'
        >>> NewGELUActivation = type("NewGELUActivation", (nn.Module,), {})
        >>> NewGELUActivation.__module__ = "transformers.activations"
        >>> torch_equivalent(NewGELUActivation()).__name__
        'GELU'
    """
    return _equivalent(type(module)) or type(module)


def is_kind(module: nn.Module, types: type[nn.Module] | tuple[type[nn.Module], ...]) -> bool:
    """``isinstance(module, types)``, or a known third-party activation of one of ``types``.

    Example:
        >>> GELU = type("GELU", (nn.Module,), {"__module__": "timm.layers.activations"})
        >>> is_kind(GELU(), nn.GELU), is_kind(GELU(), (nn.ReLU, nn.SiLU))
        (True, False)
    """
    if isinstance(module, types):
        return True
    found = _equivalent(type(module))
    return found is not None and issubclass(found, types)
