"""The gradient rules on the host (numpy, ``float32``): one step's norms in, each rule's flags out.

Also the running scale that a spike is measured against (an EMA of the log and of its spread).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from lightning_hooks.core.alarms.rules import GRADIENT_RULES, AlarmRules

__all__ = [
    "DEAD_STEPS",
    "GradientReport",
    "GradientRules",
    "HostSegments",
    "RunningScale",
    "Thresholds",
    "as_array",
    "lower_median",
]

# the log of the largest float32 norm
_LOG_MAX: np.float32 = np.float32(np.log(np.finfo(np.float32).max))


def as_array(value: torch.Tensor | np.ndarray | Sequence[float]) -> np.ndarray:
    """Read a saved state entry as a host array.

    Args:
        value: the entry: a tensor, an array or a sequence of floats.

    Returns:
        The entry as a numpy array on the host.
    """
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def lower_median(values: np.ndarray) -> np.float32:
    """Return the median, the lower of the two middle values for an even count.

    That is ``torch.median``'s choice.

    Args:
        values: a 1-d array, not empty.

    Returns:
        The median.
    """
    middle = (values.size - 1) // 2
    low: np.float32 = np.partition(values, middle)[middle]
    return low


def _vanishing_floor(live: np.ndarray, fraction: float) -> np.float32:
    """Return *vanishing*'s floor: ``fraction`` of the live layers' lower median.

    Args:
        live: the norms of the layers with a finite gradient.
        fraction: the rules' ``vanish_fraction``.

    Returns:
        The floor, 0 where no layer is live (a zero norm is then always tiny).
    """
    floor: np.float32 = np.float32(0.0)
    if live.size:
        floor = lower_median(live) * np.float32(fraction)
    return floor


class GradientReport(NamedTuple):
    """One step's verdicts of the gradient rules, and what they were judged against.

    The fields are views of one ``float32`` array, ``[rows]`` each (the layers, then the global
    row), made once per array (a quiet step's report is reused whole:
    :attr:`GradientRules.quiet`).

    Example:
        >>> report = GradientReport.over(np.zeros((11, 3), dtype=np.float32))
        >>> report.flags.shape, report.norm.shape, np.shares_memory(report.norm, report.traced)
        ((7, 3), (3,), True)
        >>> report.flags[1, 2] = 1.0
        >>> report.fired_rules(), report.fired("explosion").tolist()
        (['explosion'], [0.0, 0.0, 1.0])
    """

    flags: np.ndarray
    """``[rules, rows]``: 1 where a rule of :data:`GRADIENT_RULES` (in its order) fired."""
    norm: np.ndarray
    """The gradient L2 norms (NaN: a row the optimizer did not step)."""
    scale: np.ndarray
    """Each norm's running scale before this step (NaN: not armed yet)."""
    band: np.ndarray
    """The spike band's half-width, in log (``inf``: not armed yet)."""
    floor: np.ndarray
    """*vanishing*'s floor (NaN: the rule is off)."""
    traced: np.ndarray
    """``[3, rows]``: the norm, scale and band together, what :class:`NormRing` keeps."""

    @classmethod
    def over(cls, array: np.ndarray) -> GradientReport:
        """Return the report whose fields are views of ``array``.

        Args:
            array: ``[rules + 4, rows]``, its rows the flags of each rule, then the norm,
                scale, band and floor.

        Returns:
            The report over ``array``.
        """
        rules = len(GRADIENT_RULES)
        norm, scale, band, floor = array[rules:]
        return cls(array[:rules], norm, scale, band, floor, array[rules : rules + 3])

    @classmethod
    def zeros(cls, rows: int) -> GradientReport:
        """Return a report over a new array of zeros: no flag set.

        Args:
            rows: the number of rows (the layers, then the global row).

        Returns:
            The report.
        """
        # the flags, then the norm, scale, band and floor
        return cls.over(np.zeros((len(GRADIENT_RULES) + 4, rows), dtype=np.float32))

    def fired(self, rule: str) -> np.ndarray:
        """Return the flags of ``rule``.

        Args:
            rule: one of :data:`GRADIENT_RULES`.

        Returns:
            ``[rows]``, 1 where it fired.
        """
        flags: np.ndarray = self.flags[GRADIENT_RULES.index(rule)]
        return flags

    def fired_rules(self) -> list[str]:
        """Return the rules that fired at some row.

        Returns:
            Their names, in the order of :data:`GRADIENT_RULES`.
        """
        return [GRADIENT_RULES[index] for index in np.flatnonzero(self.flags.any(axis=1))]


class Thresholds(NamedTuple):
    """What :meth:`RunningScale.thresholds` returns: per factor, each row's ceilings and bands."""

    ceilings: list[np.ndarray]
    """Per factor, the ``log`` of its spike threshold per row."""
    armed: np.ndarray
    """Whether each row has seen ``min_history`` finite steps."""
    bands: np.ndarray
    """``[factors, rows]``: ``max(spike_sigmas * std, log(factor))`` (``inf`` until armed)."""


class HostSegments:
    """Which row each per-parameter gradient norm belongs to.

    :meth:`fold` turns a quiet step's ``[parameters]`` norms into the rows the rules read, in
    buffers made once.

    Args:
        owner: the layer row of each parameter (``0 .. layers - 1``), in parameter order.
        layers: the number of layer rows (the global row comes after them).
        unique: positions the global row sums over (a tied parameter once, in order).
    """

    def __init__(self, owner: Sequence[int], layers: int, unique: Sequence[int]) -> None:
        self.owner = np.asarray(owner, dtype=np.int64)
        self.layers = layers
        distinct = list(unique) == list(range(len(owner)))
        self.unique = None if distinct else np.asarray(unique, dtype=np.int64)
        # Parameters are grouped by layer (ParamLayout's order): each layer's run starts here,
        # and one ``reduceat`` sums them; any other order takes ``bincount``.
        starts = np.flatnonzero(np.diff(self.owner, prepend=-1))
        runs = len(starts) == layers and (self.owner[starts] == np.arange(layers)).all()
        self._starts = starts if runs and layers > 0 else None
        self._squares = np.zeros(len(owner), dtype=np.float64)
        self._rows = np.zeros(layers + 1, dtype=np.float64)
        self._out = np.zeros(layers + 1, dtype=np.float32)

    def fold(self, norms: np.ndarray) -> np.ndarray:
        """Fold per-parameter norms into the rows' norms.

        Squares are summed in float64; NaN and Inf propagate.

        Args:
            norms: ``[parameters]`` L2 norms, in parameter order.

        Returns:
            ``[layers + 1]`` float32 L2 norms: each layer's, then the global norm. The array is
            reused by the next call.
        """
        squares = self._squares
        rows = self._rows
        np.multiply(norms, norms, out=squares, dtype=np.float64)
        if self._starts is not None:
            np.add.reduceat(squares, self._starts, out=rows[:-1])
        else:
            rows[:-1] = np.bincount(self.owner, weights=squares, minlength=self.layers)
        rows[-1] = squares.sum() if self.unique is None else squares[self.unique].sum()
        np.sqrt(rows, out=rows)
        self._out[...] = rows
        return self._out


class RunningScale:
    """Per row: EMA of ``log x`` and of its variance, and the count of finite steps seen.

    Views of one ``float32`` state array, updated in place.

    Args:
        rows: the number of rows.
        rules: the alarm rules (``window``, ``min_history``, ``spike_sigmas``).
    """

    def __init__(self, rows: int, rules: AlarmRules) -> None:
        self.state = np.zeros((3, rows), dtype=np.float32)  # mean, variance, count
        self.mean, self.var, self.count = self.state
        self.alpha = np.float32(2.0 / (rules.window + 1))
        self.armed_at = float(rules.min_history)
        self.sigmas = np.float32(rules.spike_sigmas)
        self._logs: dict[tuple[float, ...], np.ndarray] = {}  # ``[[log f], ...]`` per factors
        self._steady = False
        self._keep = np.float32(1.0) - self.alpha  # what the variance keeps of a steady step
        self._spread = np.zeros(rows, dtype=np.float32)  # work buffers of the quiet steps
        self._top = np.zeros(rows, dtype=np.float32)

    def thresholds(self, *factors: float) -> Thresholds:
        """Return each factor's spike thresholds and bands.

        Args:
            *factors: the spike factors (``inf``: off).

        Returns:
            Per factor, the ``log`` of its spike threshold per row; whether each row is armed;
            and each factor's band, ``max(spike_sigmas * std, log(factor))`` (``inf`` until
            armed).
        """
        logs = self._logs.get(factors)
        if logs is None:
            logs = np.array([[math.log(f)] for f in factors], np.float32)
            self._logs[factors] = logs
        armed = self.count >= self.armed_at
        bands = np.maximum(self._std_band(), logs)  # [factors, rows]
        bands[:, ~armed] = np.inf
        return Thresholds(list(bands + self.mean), armed, bands)

    def load(self, state: torch.Tensor | np.ndarray) -> None:
        """Restore a saved :attr:`state`.

        Args:
            state: the saved state (a tensor, or an array).
        """
        self.state[...] = as_array(state)
        self._steady = False

    def steady(self) -> bool:
        """Return whether every row is armed and past its first ``1 / alpha`` steps.

        Then the EMA's weight is ``alpha`` everywhere.

        Returns:
            Whether the scale is steady; true from then on, until :meth:`load`.
        """
        if not self._steady:
            count = self.count
            armed = bool((count >= self.armed_at).all())
            self._steady = armed and bool((np.reciprocal(np.maximum(count, 1)) <= self.alpha).all())
        return self._steady

    def quiet_ceiling(
        self, low: np.float32 | None, band: np.ndarray, first: np.float32
    ) -> np.ndarray | np.float32:
        """Return the lowest ceiling, where :meth:`steady`.

        Args:
            low: the log of the lowest factor (``None``: ``first`` is the lowest).
            band: written with the first factor's band.
            first: the log of the first factor (``inf``: off).

        Returns:
            ``mean + max(spike_sigmas * std, low)``; ``_LOG_MAX`` where every factor is off.
        """
        spread = self._std_band(out=self._spread)
        np.maximum(spread, first, out=band)
        bound = band if low is None else np.maximum(spread, low, out=spread)
        if bound is band and first == math.inf:  # no ceiling: only a non-finite norm stands out
            return _LOG_MAX
        top: np.ndarray = np.add(bound, self.mean, out=self._top)
        return top

    def update(self, log_x: np.ndarray, keep: np.ndarray, ceiling: np.ndarray) -> None:
        """Fold ``log_x`` into the rows where ``keep``.

        Above ``ceiling`` (a spike) only the mean moves, clamped at the ceiling: a lasting
        change of level is learnt in a few dozen steps, and the spread does not grow with each
        spike.

        Args:
            log_x: ``[rows]`` logs of this step's norms.
            keep: ``[rows]``, true for the rows the scale learns from.
            ceiling: ``[rows]`` spike ceilings, in log.
        """
        self.count += keep
        weight = np.maximum(np.reciprocal(np.maximum(self.count, np.float32(1.0))), self.alpha)
        weight *= keep
        delta = np.where(keep, np.minimum(log_x, ceiling), self.mean) - self.mean
        spread = weight * (log_x <= ceiling)
        self._fold(delta, weight, spread, np.float32(1.0) - spread)

    def update_steady(self, log_x: np.ndarray) -> None:
        """Do :meth:`update` where :meth:`steady`, every row kept and none above its ceiling.

        The same state, in half the numpy calls.

        Args:
            log_x: ``[rows]`` logs of this step's norms.
        """
        self.count += np.float32(1.0)
        delta = np.subtract(log_x, self.mean, out=self._spread)
        self._fold(delta, self.alpha, self.alpha, self._keep, out=self._top)

    def _std_band(self, out: np.ndarray | None = None) -> np.ndarray:
        """Return ``spike_sigmas * std`` per row, the least of every factor's band."""
        spread = np.sqrt(self.var, out=out)
        spread *= self.sigmas
        return spread

    def _fold(
        self,
        delta: np.ndarray,
        weight: np.ndarray | np.float32,
        spread: np.ndarray | np.float32,
        keep: np.ndarray | np.float32,
        out: np.ndarray | None = None,
    ) -> None:
        """The EMA step both updates share; ``delta`` (``log x - mean``) is overwritten."""
        self.mean += np.multiply(delta, weight, out=out)
        delta *= delta
        delta *= spread
        self.var += delta
        self.var *= keep


DEAD_STEPS = 5
"""*vanishing* names a dead network after this many optimizer steps: a layer, and every layer
before it, get exactly zero gradient while a later layer still gets some. A whole ReLU layer
that stopped firing passes no gradient back, and it never fires again: waiting the
``vanish_steps`` of a merely small gradient only delays the warning."""


class GradientRules:
    """The gradient rules on one step's ``[rows]`` gradient norms, with their state.

    *spike*, *explosion*, *absolute*, *vanishing*, *nonfinite*, *amp_overflow* and the notice
    *no_gradient*; the rows are the layers, then the global norm.

    Args:
        rows: the number of rows.
        rules: the alarm rules and their thresholds.
    """

    def __init__(self, rows: int, rules: AlarmRules) -> None:
        self.rows = rows
        self.rules = rules
        self.scale = RunningScale(rows, rules)
        self.low = np.zeros(rows, dtype=np.int64)
        """Per layer, the consecutive tiny steps (*vanishing*)."""
        self.empty = np.zeros(rows, dtype=np.int64)
        """Per layer, the consecutive steps it got no gradient: none, or exactly 0
        (*no_gradient*)."""
        self.named = np.zeros(rows, dtype=bool)
        """The layers already named as getting no gradient: by *no_gradient*, or as part of a
        dead network (*vanishing*); each is named once per fit."""
        self.cut = -1
        """The deepest layer of a dead network at the last step (-1: none)."""
        self.cut_steps = 0
        """The consecutive steps with that layer the deepest of a dead network."""
        self._is_layer = np.arange(rows) < rows - 1
        self._false = np.zeros(rows, dtype=bool)
        self._true = np.ones(rows, dtype=bool)  # every row stepped
        self._rows: tuple[object, np.ndarray | None] = (None, None)
        self._factors = [rules.spike_factor or math.inf, *filter(None, [rules.explode_factor])]
        self.quiet = GradientReport.zeros(rows)
        """The report of a step on which no rule fired (:meth:`_quiet_report`), reused (no flag
        is ever set in it)."""
        logs = [np.float32(math.log(f)) for f in self._factors]
        self._log_first = logs[0]  # the band the report gives: the spike rule's
        self._low_log = None if min(logs) == logs[0] else min(logs)

    def state_dict(self) -> dict[str, Any]:
        """Return the gradient rules' state, for a checkpoint.

        Returns:
            The running scale, the *vanishing* counters and the cut of a dead network, by name.
        """
        return {
            "scale": torch.from_numpy(self.scale.state.copy()),
            "low": torch.from_numpy(self.low.copy()),
            "dead": (self.cut, self.cut_steps),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Args:
            state: what :meth:`state_dict` returned, among the alarms' other entries, in the
                current format (:func:`~lightning_hooks.core.alarms.saved_state.upgrade`).
        """
        self.scale.load(state["scale"])
        self.low[...] = as_array(state["low"])
        cut, cut_steps = state["dead"]
        self.cut = int(cut)
        self.cut_steps = int(cut_steps)

    def host_rows(self, rows: Sequence[int] | torch.Tensor | None) -> np.ndarray | None:
        """Return ``rows`` as a host array.

        Converted only when not the last step's object, so a device tensor passed each step is
        read once.

        Args:
            rows: the rows an optimizer's norms cover (``None``: all).

        Returns:
            The rows as an int64 array, or ``None``.
        """
        if rows is None:
            return None
        if rows is not self._rows[0]:
            host = rows.tolist() if isinstance(rows, torch.Tensor) else rows
            self._rows = (rows, np.asarray(host, dtype=np.int64))
        return self._rows[1]

    def read(
        self, value: np.ndarray, rows: np.ndarray | None, amp: bool, clip: float | None
    ) -> GradientReport:
        """Run :meth:`evaluate` on a posted copy.

        Args:
            value: the norms, with the stepped rows beside them as a second row when some were
                not.
            rows: the rows it covers (``None``: all).
            amp: a GradScaler is active: a non-finite norm is an overflow it skips.
            clip: the largest global L2 norm the optimizer applies, for *explosion*.

        Returns:
            The report of this step's verdicts.
        """
        norm = value[0] if value.ndim == 2 else value
        stepped = value[1] > 0 if value.ndim == 2 else None
        every_row_active = stepped is None
        active = self._true if stepped is None else stepped
        held = self._true
        if rows is not None and rows.size != self.rows:  # not one optimizer stepping every layer
            subset = norm
            norm = np.full(self.rows, np.nan, dtype=np.float32)
            norm[rows] = subset
            # The global row of a subset (a GAN's generator, say) is not comparable from step to
            # step with another optimizer's: it stays out of the rules, its layers do not.
            active = np.zeros(self.rows, dtype=bool)
            active[rows[:-1]] = True if stepped is None else stepped[:-1]
            every_row_active = False
            held = np.zeros(self.rows, dtype=bool)
            held[rows[:-1]] = True
        with np.errstate(all="ignore"):
            return self.evaluate(norm, active, amp, clip, held, every_row_active=every_row_active)

    def evaluate(  # noqa: PLR0913 (a step's facts, on the quiet step's path: no record per step)
        self,
        norm: np.ndarray,
        active: np.ndarray,
        amp: bool,
        clip: float | None,
        held: np.ndarray | None = None,
        *,
        every_row_active: bool = False,
    ) -> GradientReport:
        """Return the rules' report on one step's ``norm``; the state updated.

        Args:
            norm: ``[rows]`` gradient L2 norms, the global one last.
            active: ``[rows]``, false for a row no gradient reached at this step.
            amp: a GradScaler is active: a non-finite norm is an overflow it skips.
            clip: the largest global L2 norm the optimizer applies, for *explosion*.
            held: ``[rows]``, the rows whose trainable parameters the optimizer stepping holds
                (``None``: every row); a layer out of it (frozen) is never *no_gradient*.
            every_row_active: every row got a gradient (``active`` is all true), so a step where
                no rule can fire may take the quiet report (:meth:`_quiet_report`).

        Returns:
            The report of this step's verdicts.
        """
        held = self._true if held is None else held
        log_norm = np.log(norm)
        if every_row_active and self.scale.steady():
            quiet = self._quiet_report(norm, log_norm)
            if quiet is not None:
                return quiet
        rules = self.rules
        no = self._false
        ceilings, armed, bands = self.scale.thresholds(*self._factors)
        ceiling = ceilings[0]
        scale = np.where(armed, np.exp(self.scale.mean), np.float32(np.nan))
        finite = np.abs(log_norm) < math.inf  # a positive, finite norm
        bad = active & ~(np.abs(norm) < math.inf)
        overflow = amp and bool(bad.any())
        ok = active & (not overflow)
        spike = (log_norm > ceiling) & finite & ok if rules.spike_factor is not None else no
        keep = finite & ok  # what the scale learns
        explosion = self._explosion(log_norm, clip, keep, ceilings[-1])
        cap = rules.max_grad_norm
        absolute = (norm > cap) & ok & ~self._is_layer if cap is not None else no
        empty = self._count_empty(norm, active, held & self._is_layer, overflow)
        vanishing, floor, around = self._vanishing(norm, ok & self._is_layer, finite)
        nonfinite = bad & self._is_layer & (not overflow) if rules.nonfinite else no
        amp_flag = ~self._is_layer & overflow
        no_gradient = self._no_gradient(empty, around)
        self.scale.update(log_norm, keep, ceiling)
        # in the order of GRADIENT_RULES
        flags = [spike, explosion, absolute, vanishing, nonfinite, amp_flag, no_gradient]
        report = np.stack([*flags, norm, scale, bands[0], floor]).astype(np.float32, copy=False)
        return GradientReport.over(report)

    def _quiet_report(self, norm: np.ndarray, log_norm: np.ndarray) -> GradientReport | None:
        """Make :meth:`evaluate`'s report and state in half its numpy calls, where no rule fires.

        For a step where no rule can fire (clipping only lowers a norm); else ``None``.
        """
        report = self.quiet
        scale = self.scale
        # the lowest ceiling, mean + max(spread, log of the lowest factor): exactly the least
        # of the factors' ceilings (adding the mean rounds monotonically)
        top = scale.quiet_ceiling(self._low_log, report.band, self._log_first)
        if not (log_norm <= top).all():  # NaN and Inf too
            return None
        cap = self.rules.max_grad_norm
        if cap is not None and not norm[-1] <= cap:
            return None
        layers = norm[:-1]
        fraction = self.rules.vanish_fraction
        # every layer above the floor: none is zero, so this is the median of the live ones
        floor = _vanishing_floor(layers, fraction) if fraction is not None else 0
        if not (layers > floor).all():
            return None
        report.norm[...] = norm
        np.exp(scale.mean, out=report.scale)
        report.floor[...] = floor if fraction is not None else np.nan
        self.low[:-1] = 0  # no layer is tiny: every run of tiny steps ends
        self.empty[:-1] = 0  # and every layer got a gradient
        self.cut_steps = 0  # and no layer is dead
        self.cut = -1
        scale.update_steady(log_norm)  # every row kept, none above its spike ceiling
        return report

    def _explosion(
        self, log_norm: np.ndarray, clip: float | None, keep: np.ndarray, ceiling: np.ndarray
    ) -> np.ndarray:
        """Return *explosion*'s flags: rows above ``ceiling`` once clipped.

        Only when the global row is too (or is out of the rules): one layer alone jumps in
        healthy runs (an embedding meeting rare tokens).
        """
        if self.rules.explode_factor is None:
            return self._false
        if clip is not None:  # every row scales by min(1, clip / global norm)
            log_norm = log_norm + min(np.float32(math.log(clip)) - log_norm[-1], np.float32(0))
        fired: np.ndarray = (log_norm > ceiling) & keep
        last: np.bool_ = fired[-1] | ~keep[-1]
        return fired & last

    def _vanishing(
        self, norm: np.ndarray, layers: np.ndarray, finite: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Return the layers *vanishing* warns of, the floor, and the layers gradient flows around.

        The first are the layers that finished a run of ``vanish_steps`` tiny steps that
        *vanishing* warns of; the last, those that finished one the gradient flows around (a
        notice).

        A vanishing gradient starves what lies before it: it warns where every stepped layer
        before the tiny one is tiny too, so that the gradient does not reach the network's
        first layers. Where a layer before it still gets a gradient, the gradient goes around
        the tiny layer (a residual block whose units are mostly dead, an idle branch or
        expert), the rest trains, and it is the notice *no_gradient*. A run of exact zeros is
        *no_gradient*'s too (:meth:`_no_gradient`); only a dead network warns of one.
        """
        fraction = self.rules.vanish_fraction
        if fraction is None:
            return self._false, np.full_like(norm, np.nan), self._false
        live = norm[finite & layers]
        floor = _vanishing_floor(live, fraction)
        tiny = (norm <= floor) & layers
        self.low *= tiny | ~layers  # a layer not stepped keeps its count
        self.low += tiny
        done = (self.low == self.rules.vanish_steps) & tiny & (self.empty < self.low)
        # a layer a gradient reaches before this one: ``tiny`` is false there (not stepped: it
        # stands aside, neither way)
        around = ~np.logical_and.accumulate(tiny | ~layers)
        fired = done & ~around
        dead = self._dead_network(norm, layers)
        if dead is not None:
            self.low[dead] = self.rules.vanish_steps + 1  # named as one network, not layer by layer
            self.named[dead] = True
            if self.cut_steps == DEAD_STEPS:
                fired[dead[-1]] = True  # the deepest: every layer before it is cut off too
        return fired, np.full_like(norm, floor), done & around

    def _count_empty(
        self, norm: np.ndarray, active: np.ndarray, held: np.ndarray, overflow: bool
    ) -> np.ndarray:
        """Count the consecutive steps each ``held`` layer got no gradient.

        No gradient: none reached it, or its norm is exactly 0. A layer not held keeps its
        count, and an overflowed step counts for none.

        Returns:
            The layers that got none at this step.
        """
        empty: np.ndarray = held & (~active | (norm == 0)) & (not overflow)
        self.empty *= empty | ~held
        self.empty += empty
        return empty

    def _no_gradient(self, empty: np.ndarray, around: np.ndarray) -> np.ndarray:
        """Return the flags of *no_gradient*, a notice.

        The layers whose run of steps with no gradient (``empty`` now) reached ``vanish_steps``
        at this step, and those whose run of tiny steps the gradient flows ``around``; each
        once per fit (a layer of a dead network is *vanishing*'s, which warns). An idle expert,
        an unused branch or a dead unit's residual block gets no gradient while the network
        trains around it: a fact, not a harm.
        """
        if self.rules.vanish_fraction is None:
            return self._false
        ran_out = (self.empty >= self.rules.vanish_steps) & empty
        fired: np.ndarray = (ran_out | around) & ~self.named
        self.named |= fired
        return fired

    def _dead_network(self, norm: np.ndarray, layers: np.ndarray) -> np.ndarray | None:
        """Return the rows of a dead network once it has held :data:`DEAD_STEPS` steps.

        Else ``None``. In a dead network the stepped layers whose gradient is exactly zero are
        the first ones, in the model's order, and a later layer still gets a gradient (a
        mixture of experts' idle expert, between live layers, is not one). It is named once per
        run of such steps, however deep the cut grows.
        """
        stepped = np.flatnonzero(layers)
        zero = norm[stepped] == 0
        first_live = int(np.argmin(zero)) if not zero.all() else zero.size
        cut = first_live > 0 and first_live < zero.size and not zero[first_live:].any()
        self.cut_steps = self.cut_steps + 1 if cut else 0
        self.cut = int(stepped[first_live - 1]) if cut else -1
        if self.cut_steps < DEAD_STEPS:
            return None
        return stepped[:first_live]
