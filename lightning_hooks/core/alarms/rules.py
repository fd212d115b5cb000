"""The alarm rules' names, thresholds and defaults (:class:`AlarmRules`)."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_hooks.core import checks
from lightning_hooks.core.checks import named_arguments

__all__ = ["ALARM_RULES", "GRADIENT_RULES", "QUIET_READS", "AlarmRules", "WeightNorms"]

GRADIENT_RULES = (
    "spike",
    "explosion",
    "absolute",
    "vanishing",
    "nonfinite",
    "amp_overflow",
    "no_gradient",
)
"""The rules :class:`GradientRules` judges on the gradient norms, in the order of its report's
flags (the loss, *stall* and *attention* have reports of their own)."""

ALARM_RULES = (*GRADIENT_RULES, "loss_spike", "diverging", "setback", "stall", "attention")
"""Names of the rules, in the order of :attr:`TrainingAlarms.counts`."""

QUIET_READS = ("grouped", "triton")
"""The values of :attr:`AlarmRules.quiet_read`."""

_EVERY_N_STEPS_DEPRECATED = (
    "AlarmRules(every_n_steps=...) is deprecated: use evaluate_every_n_steps=..., the same "
    "steps 0, n, 2n"
)

WeightNorms = Callable[[], torch.Tensor]
"""Returns ``[layers + 1]`` weight L2 norms (last: all); called on the host when a rule fired."""


def _renamed_every_n_steps(cls: type[AlarmRules]) -> type[AlarmRules]:
    """Make the constructor take ``every_n_steps=`` as ``evaluate_every_n_steps=``.

    A class decorator, outside :func:`named_arguments` (whose check would refuse the old name).
    The old name is taken with a ``DeprecationWarning``. The signature ``help()`` and
    LightningCLI read stays the new one.

    Args:
        cls: the class whose own ``__init__`` is wrapped.

    Returns:
        ``cls``, its constructor wrapped; the wrapper raises ``TypeError`` where both names are
        given.
    """
    checked: Callable[..., None] = vars(cls)["__init__"]

    @functools.wraps(checked)
    def init(self: AlarmRules, *args: object, **kwargs: object) -> None:
        if "every_n_steps" in kwargs:
            warnings.warn(_EVERY_N_STEPS_DEPRECATED, DeprecationWarning, stacklevel=2)
            if "evaluate_every_n_steps" in kwargs:
                raise TypeError(
                    "AlarmRules(every_n_steps=..., evaluate_every_n_steps=...): the same "
                    "argument twice, under its old and its new name; give evaluate_every_n_steps"
                )
            kwargs["evaluate_every_n_steps"] = kwargs.pop("every_n_steps")
        checked(self, *args, **kwargs)

    setattr(cls, "__init__", init)  # noqa: B010 (mypy refuses assigning to a method)
    return cls


@_renamed_every_n_steps
@named_arguments
@dataclass(frozen=True)
class AlarmRules:
    """Which alarm rules are on, and their thresholds (defaults from ``benchmarks/alarms.py``).

    A factor or bar set to ``None`` turns its rule (or path) off.

    Args:
        spike_factor: *spike*: a layer's (or the global) gradient norm exceeds this many times its
            running scale and ``spike_sigmas`` spreads of the log-norm above it. Must be > 1.
        spike_sigmas: running standard deviations of the log-norm (or loss) a spike must also
            clear above the running mean.
        explode_factor: *explosion*: the gradient the optimizer applies (after the clip, when
            the caller gives it), globally and for the layer named, exceeds this many times its
            running scale (and ``spike_sigmas`` spreads). Must be > 1.
        window: span, in evaluated steps, of the running scale: EMA weight
            ``2 / (window + 1)`` (the exact mean and variance over the first steps).
        min_history: finite steps a row needs before the spike rules arm (and losses before
            *diverging*'s noise bar arms; the run's start and its first best are their mean).
        max_grad_norm: *absolute*: the global gradient norm exceeds this value (off by default).
        vanish_fraction: *vanishing*: a layer's gradient norm is zero, or below this fraction
            of the median norm of the layers whose gradient is not zero ...
        vanish_steps: ... for this many consecutive evaluated steps (fires once per such run).
            A trainable layer that got no gradient at all (none, or exactly 0) for this many
            steps is the notice *no_gradient*, once per fit: an unused branch, an idle expert.
            Only a dead network (that layer and every layer before it get none, while a later
            one still gets some) is a *vanishing* warning.
        nonfinite: *nonfinite*: a NaN/Inf gradient norm, naming the layer where it entered.
        evaluate_every_n_steps: evaluate the rules on optimizer steps ``0, n, 2n, ...`` (1: every
            step); with several optimizers, each on every n-th of its own steps. Not a
            callback's ``every_n_steps``, whose logging steps are ``n - 1, 2n - 1, ...``;
            ``every_n_steps=`` is still taken here, with a ``DeprecationWarning``.
        loss_factor: *loss_spike*: the training loss exceeds this many times its running scale
            (and ``spike_sigmas`` spreads above it); off by default.
        diverge_ratio: *setback*, then *diverging*, on the training loss. A setback opens when
            the loss's short running mean (an EMA over ``diverge_span`` optimizer steps' losses)
            rises above its best level so far by ``(diverge_ratio - 1) x |best|``, and by the
            two margins below. The best is the lowest of a running level that lengthens with
            the loss's noise, so a lucky micro-batch is not a best. A setback is logged with
            its step, never warned, and acted on by no ``on_alarm``; a loss that is not finite
            is *diverging* at once. Must be > 1.
        diverge_giveback: the rise must also give back at least this fraction of what the run
            had learnt: its start (the mean of its first ``min_history`` losses) minus its best.
        diverge_noise: the rise must also clear that bar by this many standard deviations of
            the short running mean's own noise, measured from one loss to the next (a trend
            does not count as noise). 0 turns this margin off.
        diverge_span: the span, in optimizer steps, of the loss's short running mean. Under
            gradient accumulation the callback reads every micro-batch's loss: the span is this
            many steps of them.
        diverge_early: the first this many optimizer steps of an adaptive optimizer (whose
            first updates overshoot) are held to the bar ``diverge_overshoot`` x the best
            instead of ``diverge_ratio`` x the best.
        diverge_overshoot: the bar of ``diverge_early``'s first steps (>= ``diverge_ratio``).
        diverge_patience: a setback is confirmed as *diverging* (which warns, stops or raises
            under ``on_alarm``) once this many of its optimizer steps in a row have a mean
            loss over the bar themselves, not only the running mean that remembers an earlier
            one. 1 confirms at once. A step back under the bar starts the count again; the
            micro-batches of one step, read at the same weights, count once.
        diverge_lost: a setback is also confirmed as *diverging* once the loss is above this
            many times the run's start (plus the noise margin; once ``min_history`` losses are
            in). The loss compared is the running mean, or, once the run's best is under half
            its start, the median loss of the last ``2 * diverge_patience - 1`` optimizer
            steps, which one or two outlier batches cannot move. A setback that falls back
            under the bar before it is confirmed is logged as recovered. Must be > 0. After
            one or two outlier batches, the rise that follows is held as their echo and
            confirms nothing for a while (``LossRules`` explains the hold).
        stall_factor: *stall*: on a logging step, the median ``|w_after - w_before| / lr`` over
            a sample of each tensor's entries with a non-zero gradient fell this many times
            below its running level. Adaptive optimizers only; not evaluated while the learning
            rate is under 1% of its peak. Must be > 1.
        stall_progress: ... and the best running mean of the loss improved since the previous
            logging step by at most this share of what the run had learnt (1: not checked).
        history: steps of per-layer norms kept in the host ring buffer that an alarm reports.
        attn_logit_max: *attention*: at a logging step, a layer's largest attention logit
            (``stability/attn_logit_max``) is above this and its most focused head's mean entropy
            (``stability/attn_entropy_min``) is below ``attn_entropy_min`` ...
        attn_min_layers: ... in at least this many attention layers (all, in a model with fewer).
        attn_growth: ... or the logit grew at least this many times at each of the last two
            logging steps. Must be > 1.
        attn_logit_min: ... from at least this logit, while at least ``attn_min_layers``
            layers' logits are that large. Must be > 0.
        attn_entropy_min: the entropy (nats) below which a head is one-hot, for both paths.
        quiet_read: how a quiet step reads the gradients' norms: ``"grouped"`` (one
            ``torch._foreach_norm`` over gradients stacked by shape and dtype) or ``"triton"``
            (CUDA, contiguous float gradients of one dtype); where it cannot run, one
            ``torch._foreach_norm`` after one warning.

    Raises:
        ValueError: a threshold is out of its range (the error names it), or
            ``diverge_overshoot`` < ``diverge_ratio``, or ``min_history`` > ``window``.
        TypeError: a threshold is of the wrong type, or ``every_n_steps`` and
            ``evaluate_every_n_steps`` are both given.

    Example:
        >>> AlarmRules(spike_factor=20.0).window
        50
        >>> AlarmRules(spike_factor=0.5)
        Traceback (most recent call last):
        ...
        ValueError: AlarmRules(spike_factor=0.5): must be a finite real > 1.0, got 0.5
    """

    spike_factor: float | None = 10.0
    explode_factor: float | None = 300.0
    spike_sigmas: float = 4.0
    window: int = 50
    min_history: int = 3
    max_grad_norm: float | None = None
    vanish_fraction: float | None = 1e-3
    vanish_steps: int = 20
    nonfinite: bool = True
    evaluate_every_n_steps: int = 1
    loss_factor: float | None = None
    history: int = 16
    diverge_ratio: float | None = 2.0
    diverge_giveback: float = 0.5
    diverge_noise: float = 1.0
    diverge_span: int = 4
    diverge_early: int = 3
    diverge_overshoot: float = 10.0
    diverge_patience: int = 3
    diverge_lost: float = 1.5
    stall_factor: float | None = 100.0
    stall_progress: float = 0.02
    attn_logit_max: float | None = 1e3
    attn_entropy_min: float = 0.1
    attn_min_layers: int = 2
    attn_growth: float | None = 1.3
    attn_logit_min: float = 100.0
    # ``str``, not a ``Literal``: LightningCLI then passes a wrong value on to the check, whose
    # error names the allowed values
    quiet_read: str = "grouped"

    @property
    def every_n_steps(self) -> int:
        """Deprecated: :attr:`evaluate_every_n_steps` (the same steps ``0, n, 2n, ...``)."""
        warnings.warn(_EVERY_N_STEPS_DEPRECATED, DeprecationWarning, stacklevel=2)
        return self.evaluate_every_n_steps

    def __setstate__(self, state: dict[str, object]) -> None:
        """Unpickle, a rules object pickled before ``every_n_steps`` was renamed included."""
        if "every_n_steps" in state:
            state = dict(state)
            state["evaluate_every_n_steps"] = state.pop("every_n_steps")
        for name, value in state.items():
            object.__setattr__(self, name, value)  # frozen: as the dataclass's own __init__ sets

    @property
    def watches_loss(self) -> bool:
        """Whether a rule reads the training loss (*loss_spike* or *diverging*)."""
        return self.loss_factor is not None or self.diverge_ratio is not None

    def __post_init__(self) -> None:
        """Check every threshold, and that the thresholds agree with one another.

        Raises:
            ValueError: a threshold is out of its range, or two disagree.
            TypeError: a threshold is of the wrong type.
        """

        def real(
            low: float = -math.inf,
            high: float = math.inf,
            *,
            low_open: bool = False,
            high_open: bool = False,
        ) -> Callable[[str, Any], float]:
            return functools.partial(
                checks.real,
                "AlarmRules",
                low=low,
                high=high,
                low_open=low_open,
                high_open=high_open,
            )

        positive = real(low=0.0, low_open=True)
        above_one = real(low=1.0, low_open=True)
        counts = ("window", "min_history", "vanish_steps", "evaluate_every_n_steps", "history")
        positives = ("spike_sigmas", "attn_entropy_min", "diverge_lost", "attn_logit_min")
        required: dict[str, Callable[[str, Any], Any]] = {
            "nonfinite": functools.partial(checks.boolean, "AlarmRules"),
            "quiet_read": lambda name, value: checks.choice("AlarmRules", name, value, QUIET_READS),
            "diverge_noise": real(low=0.0),
            "diverge_overshoot": above_one,
            **dict.fromkeys(positives, positive),
            **dict.fromkeys(("diverge_giveback", "stall_progress"), real(low=0.0, high=1.0)),
            **dict.fromkeys(
                (*counts, "diverge_span", "diverge_early", "diverge_patience", "attn_min_layers"),
                functools.partial(checks.positive_int, "AlarmRules"),
            ),
        }
        factors = ("spike_factor", "explode_factor", "stall_factor", "loss_factor")
        optional = {
            **dict.fromkeys((*factors, "diverge_ratio", "attn_growth"), above_one),
            "max_grad_norm": positive,
            "attn_logit_max": positive,
            "vanish_fraction": real(low=0.0, high=1.0, low_open=True, high_open=True),
        }
        for name, check in {**required, **optional}.items():
            value = getattr(self, name)
            if value is not None or name in required:
                object.__setattr__(self, name, check(name, value))
        if self.diverge_ratio is not None and self.diverge_overshoot < self.diverge_ratio:
            raise ValueError(
                f"AlarmRules(diverge_overshoot={self.diverge_overshoot}): must be at least "
                f"diverge_ratio={self.diverge_ratio}, got {self.diverge_overshoot}"
            )
        if self.min_history > self.window:
            raise ValueError(
                f"AlarmRules(min_history={self.min_history}): must be at most "
                f"window={self.window}, got {self.min_history}"
            )
