"""The gradient rules on the host: one step's norms in, the flags of each rule out."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from lightning_hooks.core.alarms.rules import _BAND, _FLOOR, _NORM, _SCALE, AlarmRules
from lightning_hooks.core.alarms.scale import RunningScale

__all__ = ["GradientRules", "lower_median"]


def lower_median(values: np.ndarray) -> np.float32:
    """The lower of the two middle values for an even count (``torch.median``'s choice)."""
    middle = (values.size - 1) // 2
    low: np.float32 = np.partition(values, middle)[middle]
    return low


class GradientRules:
    """*spike*, *explosion*, *absolute*, *vanishing*, *nonfinite* and *amp_overflow* on one
    step's ``[rows]`` gradient norms (the layers, then the global norm), read on the host: a few
    dozen numpy calls over ``rows`` floats, no kernel; the running scales and the vanishing
    counters live here, in ``float32``.

    Args:
        rows: the layers and the global row.
        rules: the rules and thresholds.
    """

    def __init__(self, rows: int, rules: AlarmRules) -> None:
        self.rows = rows
        self.rules = rules
        self.scale = RunningScale(rows, rules)
        self.low = np.zeros(rows, dtype=np.int64)
        """Per layer, the consecutive tiny steps (*vanishing*)."""
        self._is_layer = np.ones(rows, dtype=bool)
        self._is_layer[-1] = False
        self._false = np.zeros(rows, dtype=bool)
        self._true = np.ones(rows, dtype=bool)  # every row stepped (``rows_of``'s, by identity)
        self._rows: tuple[object, np.ndarray | None] = (None, None)
        self._factors = [rules.spike_factor or math.inf]
        if rules.explode_factor is not None:
            self._factors.append(rules.explode_factor)
        self.quiet = np.zeros((_FLOOR + 1, rows), dtype=np.float32)  # no flag ever set in it
        """The report of a step on which no rule fired (:meth:`_quiet_report`), reused."""
        logs = [np.float32(math.log(f)) for f in self._factors]
        self._log_first = logs[0]  # the band the report gives: the spike rule's
        self._low_log = None if min(logs) == logs[0] else min(logs)

    def host_rows(self, rows: Sequence[int] | torch.Tensor | None) -> np.ndarray | None:
        """``rows`` as a host array, converted when they are not the last step's object (a
        device tensor is read then: once, for a caller that passes the same rows each step)."""
        if rows is None:
            return None
        if rows is not self._rows[0]:
            host = rows.tolist() if isinstance(rows, torch.Tensor) else rows
            self._rows = (rows, np.asarray(host, dtype=np.int64))
        return self._rows[1]

    def read(
        self, value: np.ndarray, rows: np.ndarray | None, amp: bool, clip: float | None
    ) -> np.ndarray:
        """:meth:`evaluate` on a posted copy: the norms, with the stepped rows beside them as a
        second row when some were not (``rows``: the rows it covers; ``None``: all)."""
        norm = value[0] if value.ndim == 2 else value
        stepped = value[1] > 0 if value.ndim == 2 else None
        with np.errstate(all="ignore"):
            norm, active = self.rows_of(norm, rows, stepped)
            return self.evaluate(norm, active, amp, clip)

    def rows_of(
        self, norm: np.ndarray, rows: np.ndarray | None, stepped: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Norms of every row (NaN where not stepped) and which rows were stepped."""
        n = self.rows
        if rows is None or rows.size == n:  # one optimizer stepping every layer
            return norm, self._true if stepped is None else stepped
        full = np.full(n, np.nan, dtype=np.float32)
        full[rows] = norm
        # The global row of a subset (a GAN's generator, say) is not comparable from step to
        # step with another optimizer's: it stays out of the rules, its layers do not.
        active = np.zeros(n, dtype=bool)
        active[rows[:-1]] = True if stepped is None else stepped[:-1]
        return full, active

    def evaluate(
        self, norm: np.ndarray, active: np.ndarray, amp: bool, clip: float | None
    ) -> np.ndarray:
        """``[flags of each rule..., norm, scale, band, floor]`` x rows; the state updated."""
        log_norm = np.log(norm)
        if active is self._true and self.scale.steady():
            quiet = self._quiet_report(norm, log_norm)
            if quiet is not None:
                return quiet
        rules, no = self.rules, self._false
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
        absolute = no
        if rules.max_grad_norm is not None:
            absolute = (norm > rules.max_grad_norm) & ok & ~self._is_layer
        vanishing, floor = self._vanishing(norm, ok & self._is_layer, finite)
        nonfinite = bad & self._is_layer & (not overflow) if rules.nonfinite else no
        amp_flag = ~self._is_layer & overflow
        self.scale.update(log_norm, keep, ceiling)
        flags = [spike, explosion, absolute, vanishing, nonfinite, amp_flag]
        return np.stack([*flags, norm, scale, bands[0], floor]).astype(np.float32, copy=False)

    def _quiet_report(self, norm: np.ndarray, log_norm: np.ndarray) -> np.ndarray | None:
        """The report of a step on which no rule can fire, its state updated as
        :meth:`evaluate` would (most steps: half of its numpy calls), else ``None``. Every row
        is stepped and armed, with the EMA's weight at its floor (:meth:`RunningScale.steady`);
        none fires when each norm is finite and at most every ceiling (*spike*, *explosion*:
        clipping only lowers a norm; *absolute*), and each layer's is above the *vanishing*
        floor (so positive: every row is learnt)."""
        report, scale = self.quiet, self.scale
        # the lowest ceiling, mean + max(spread, log of the lowest factor): exactly the least
        # of the factors' ceilings (adding the mean rounds monotonically)
        top = scale.quiet_ceiling(self._low_log, report[_BAND], self._log_first)
        if not (log_norm <= top).all():  # NaN and Inf too
            return None
        cap = self.rules.max_grad_norm
        if cap is not None and not norm[-1] <= cap:
            return None
        layers = norm[:-1]
        fraction = self.rules.vanish_fraction
        # every layer above the floor: none is zero, so this is the median of the live ones
        floor = lower_median(layers) * np.float32(fraction) if fraction is not None else 0
        if not (layers > floor).all():
            return None
        report[_NORM] = norm
        np.exp(scale.mean, out=report[_SCALE])
        report[_FLOOR] = floor if fraction is not None else np.nan
        self.low[:-1] = 0  # no layer is tiny: every run of tiny steps ends
        scale.update_steady(log_norm)  # every row kept, none above its spike ceiling
        return report

    def _explosion(
        self, log_norm: np.ndarray, clip: float | None, keep: np.ndarray, ceiling: np.ndarray
    ) -> np.ndarray:
        """*explosion*: rows whose gradient as the optimizer applies it (scaled down as the
        global norm is clipped to ``clip``) is above ``explode_factor`` x the running scale, on a
        step whose global row is too (or is out of the rules: a subset's optimizer). A bad
        batch or a numerical fault blows up the whole gradient; one layer's norm alone jumps in
        healthy runs (an embedding meeting rare tokens), and per coordinate it is no outlier.
        ``ceiling``: the log of ``explode_factor`` x the running scale (inf until armed)."""
        if self.rules.explode_factor is None:
            return self._false
        if clip is not None:  # every row scales by min(1, clip / global norm)
            log_norm = log_norm + min(np.float32(math.log(clip)) - log_norm[-1], np.float32(0))
        fired: np.ndarray = (log_norm > ceiling) & keep
        last: np.bool_ = fired[-1] | ~keep[-1]
        return fired & last

    def _vanishing(
        self, norm: np.ndarray, layers: np.ndarray, finite: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Which layers finished a run of ``vanish_steps`` tiny steps, and the floor."""
        fraction = self.rules.vanish_fraction
        if fraction is None:
            return self._false, np.full_like(norm, np.nan)
        live = norm[finite & layers]
        # 0 when every layer is zero: a zero norm is always tiny
        floor = lower_median(live) * np.float32(fraction) if live.size else np.float32(0.0)
        tiny = (norm <= floor) & layers
        self.low *= tiny | ~layers  # a layer not stepped keeps its count
        self.low += tiny
        fired = (self.low == self.rules.vanish_steps) & tiny
        return fired, np.full_like(norm, floor)
