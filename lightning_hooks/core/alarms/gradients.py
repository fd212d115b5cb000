"""The gradient rules on the device: one step's norms in, the flags of each rule out."""

from __future__ import annotations

import math

import torch

from lightning_hooks.core.alarms.rules import AlarmRules
from lightning_hooks.core.alarms.scale import RunningScale

__all__ = ["GradientRules"]


class GradientRules:
    """*spike*, *explosion*, *absolute*, *vanishing*, *nonfinite* and *amp_overflow* on one
    step's ``[rows]`` gradient norms (the layers, then the global norm): a few dozen small
    kernels, no host sync; the running scales and the vanishing counters live here.

    Args:
        rows: the layers and the global row.
        rules: the rules and thresholds.
        device: where the state lives.
    """

    def __init__(self, rows: int, rules: AlarmRules, device: torch.device) -> None:
        self.rows = rows
        self.rules = rules
        self.scale = RunningScale(rows, rules, device)
        self.low = torch.zeros(rows, dtype=torch.long, device=device)
        """Per layer, the consecutive tiny steps (*vanishing*)."""
        self._is_layer = torch.ones(rows, dtype=torch.bool, device=device)
        self._is_layer[-1] = False
        self._not_layer = torch.logical_not(self._is_layer)
        self._all = torch.ones(rows, dtype=torch.bool, device=device)
        self._false = torch.zeros(rows, dtype=torch.bool, device=device)
        self._nan = torch.full((rows,), torch.nan, device=device)

    def rows_of(
        self, norm: torch.Tensor, rows: torch.Tensor | None, stepped: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Norms of every row (NaN where not stepped) and which rows were stepped."""
        n = self.rows
        if rows is None or rows.numel() == n:  # one optimizer stepping every layer: no scatter
            return norm, self._all if stepped is None else stepped
        full = norm.new_full((n,), torch.nan).index_copy_(0, rows, norm)
        # The global row of a subset (a GAN's generator, say) is not comparable from step to
        # step with another optimizer's: it stays out of the rules, its layers do not.
        active = torch.zeros_like(self._all).index_fill_(0, rows[:-1], True)
        if stepped is not None:
            active.index_copy_(0, rows[:-1], stepped[:-1])
        return full, active

    def evaluate(
        self, norm: torch.Tensor, active: torch.Tensor, amp: bool, clip: float | None
    ) -> torch.Tensor:
        """``[flags of each rule..., norm, scale, band, floor]`` x rows; the state updated.

        Python-side branches keep the usual step (every row stepped, no AMP, default rules) to
        about 50 small kernels.
        """
        rules, no = self.rules, self._false
        log_norm = norm.log()
        finite = torch.lt(log_norm.abs(), math.inf)  # a positive, finite norm
        bad = torch.lt(norm.abs(), math.inf)
        bad = bad.logical_not_() if active is self._all else torch.logical_and(active, ~bad)
        overflow = bad.any() if amp else None
        ok = active if overflow is None else active & ~overflow
        factors = [rules.spike_factor or math.inf]
        if rules.explode_factor is not None:
            factors.append(rules.explode_factor)
        ceilings, armed = self.scale.thresholds(*factors)
        ceiling = ceilings[0]
        scale = torch.where(armed, self.scale.mean.exp(), self._nan)
        band = torch.sub(ceiling, self.scale.mean)
        spike = no
        if rules.spike_factor is not None:
            spike = torch.gt(log_norm, ceiling).logical_and_(finite)
            spike = spike if ok is self._all else spike.logical_and_(ok)
        keep = finite if ok is self._all else torch.logical_and(finite, ok)  # what the scale learns
        explosion = self._explosion(log_norm, clip, keep, ceilings[-1])
        absolute = no
        if rules.max_grad_norm is not None:
            absolute = (norm > rules.max_grad_norm).logical_and_(ok).logical_and_(~self._is_layer)
        layers = self._is_layer if ok is self._all else torch.logical_and(ok, self._is_layer)
        vanishing, floor = self._vanishing(norm, layers, finite)
        nonfinite = no
        if rules.nonfinite:
            nonfinite = torch.logical_and(bad, self._is_layer)
            nonfinite = nonfinite if overflow is None else nonfinite.logical_and_(~overflow)
        amp_flag = no if overflow is None else overflow & ~self._is_layer
        self.scale.update(log_norm, keep, ceiling)
        # One kernel: the flags are promoted to float (0 or 1) beside the float rows.
        flags = [spike, explosion, absolute, vanishing, nonfinite, amp_flag]
        return torch.stack([*flags, norm, scale, band, floor])

    def _explosion(
        self, log_norm: torch.Tensor, clip: float | None, keep: torch.Tensor, ceiling: torch.Tensor
    ) -> torch.Tensor:
        """*explosion*: rows whose gradient as the optimizer applies it (scaled down as the
        global norm is clipped to ``clip``) is above ``explode_factor`` x the running scale, on a
        step whose global row is too (or is out of the rules: a subset's optimizer). A bad
        batch or a numerical fault blows up the whole gradient; one layer's norm alone jumps in
        healthy runs (an embedding meeting rare tokens), and per coordinate it is no outlier.
        ``ceiling``: the log of ``explode_factor`` x the running scale (inf until armed)."""
        if self.rules.explode_factor is None:
            return self._false
        if clip is not None:  # every row scales by min(1, clip / global norm)
            shrink = torch.rsub(log_norm[-1:], math.log(clip)).clamp_max_(0.0)
            log_norm = torch.add(log_norm, shrink)
        fired = torch.gt(log_norm, ceiling).logical_and_(keep)
        return fired.logical_and_(torch.logical_or(fired[-1:], ~keep[-1:]))

    def _vanishing(
        self, norm: torch.Tensor, layers: torch.Tensor, finite: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Which layers finished a run of ``vanish_steps`` tiny steps, and the floor."""
        fraction = self.rules.vanish_fraction
        if fraction is None:
            return self._false, self._nan
        live = torch.where(torch.logical_and(finite, layers), norm, self._nan)
        # 0 when every layer is zero: a zero norm is always tiny
        floor = torch.nanmedian(live).mul_(fraction).nan_to_num_(0.0)
        tiny = torch.le(norm, floor).logical_and_(layers)
        self.low.mul_(
            torch.logical_or(
                tiny, self._not_layer if layers is self._is_layer else torch.logical_not(layers)
            )
        ).add_(tiny)  # a layer not stepped keeps its count
        return torch.eq(self.low, self.rules.vanish_steps).logical_and_(tiny), floor.expand_as(norm)
