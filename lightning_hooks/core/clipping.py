"""The gradient clipping a run applies, as the alarms and the Trainer's readers name it."""

from __future__ import annotations

from typing import Literal, NamedTuple

from lightning_hooks.core import checks

__all__ = ["CLIP_ALGORITHMS", "Clip", "as_clip"]


class Clip(NamedTuple):
    """The gradient clipping a run applies: the Trainer's two clipping settings."""

    bound: float
    """``gradient_clip_val``: the largest norm, or the largest value of an entry."""
    algorithm: Literal["norm", "value"]
    """``gradient_clip_algorithm``: ``"norm"`` or ``"value"``."""


CLIP_ALGORITHMS: tuple[Literal["norm", "value"], ...] = ("norm", "value")
"""The ways a gradient can be clipped: by its norm, or by the value of each entry."""


def as_clip(owner: str, value: Clip | tuple[float, str]) -> Clip:
    """Check a gradient clipping given as ``(bound, algorithm)``, naming ``owner``'s ``clip``.

    Args:
        owner: the class named in the errors.
        value: the clipping given.

    Returns:
        The clipping, its bound a float.

    Raises:
        ValueError: the bound is not positive, or the algorithm is neither ``"norm"`` nor
            ``"value"``.
        TypeError: the bound is not a real number.

    Example:
        >>> as_clip("GradFlowTracker", (1, "norm"))
        Clip(bound=1.0, algorithm='norm')
    """
    bound = checks.real(owner, "clip", value[0], low=0.0, low_open=True)
    algorithm = checks.choice(owner, "clip", value[1], CLIP_ALGORITHMS)
    return Clip(bound, algorithm)
