"""*loss_spike*, *setback* and *diverging* on the training loss at each step, and their alarms.

The device only copies the loss to host memory without blocking; the rules run on the host
when the copy is read.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from lightning_hooks.core.alarms.gradients import RunningScale
from lightning_hooks.core.alarms.messages import Message, TrainingAlarm, ratio_text
from lightning_hooks.core.alarms.rules import AlarmRules
from lightning_hooks.core.alarms.setback import Setback, setback_opened, setback_recovered
from lightning_hooks.core.host_copy import HostCopy

__all__ = ["LossLevels", "LossProgress", "LossRules", "LossStory", "LossVerdict", "Setback"]

_F = np.float32
# E|x_t - x_(t-1)| = 2 sigma / sqrt(pi) for independent normal losses: the jitter to a spread
_JITTER_PER_SIGMA = 2.0 / math.sqrt(math.pi)
_JITTER_SPAN = 64  # losses in the jitter's running mean: a spread steady over a run's phases
# the level (the best's reference) lengthens until its own spread is this share of itself
_LEVEL_NOISE = 0.1
_LEVEL_SPAN_MAX = 128
_FALLS_BACK = 0.5
"""A step whose mean loss is under this share of the outlier steps' before it fell back from
them (:meth:`LossRules._falls_back`)."""
_LEARNT = 0.5
"""A run whose best loss is under this share of its start has learnt: *diverging*'s
``diverge_lost`` bar then holds the median loss of its last steps, which an outlier batch cannot
move, not the running mean, which one bad batch moves."""


class LossProgress(NamedTuple):
    """How far the loss has come: what *stall* asks of the loss rules at a logging step."""

    best: float
    """The loss's best level so far."""
    first: float
    """Where the run started: the mean of its first ``min_history`` losses."""


class LossStory(NamedTuple):
    """What the loss did, as an alarm of the gradients tells it (a dead network).

    Where the run started, its highest step, and its last steps.
    """

    start: float
    """The mean loss of the run's first optimizer step."""
    peak_step: int
    """The optimizer step of the highest mean loss so far."""
    peak: float
    """That step's mean loss."""
    trail: tuple[tuple[int, float], ...]
    """The last ``history`` optimizer steps' mean losses, oldest first: ``(step, loss)``."""

    def since(self, step: int) -> list[float]:
        """Return the mean losses of the steps from ``step`` on, in the trail.

        Args:
            step: the first optimizer step whose mean loss is returned.

        Returns:
            The mean losses, oldest first.
        """
        return [loss for at, loss in self.trail if at >= step]


class LossVerdict(NamedTuple):
    """The alarms the loss rules raised on one training loss, and its optimizer step."""

    step: int
    alarms: list[TrainingAlarm]


@dataclass
class LossLevels:
    """*diverging*'s running state over the finite training losses seen so far.

    Two running means: ``mean``, short (``diverge_span`` optimizer steps of losses), is what
    rises when the run goes wrong; ``level``, which lengthens with the loss's noise until its
    own spread is a tenth of itself, is what ``best`` is the lowest of. A best taken from the
    short mean of a noisy loss is a lucky streak, and every later loss looks like a rise
    from it.
    ``jitter``, the running mean of ``|x_t - x_(t-1)|``, measures the noise from one loss to
    the next; a trend does not inflate it, as it would a deviation from the mean.
    """

    seen: int = 0
    """Finite losses folded in."""
    first: float = math.nan
    """Where the run started: the mean of the first ``min_history`` losses, but those a setback
    held (a setback open among them keeps its losses out, as it keeps them out of the level)."""
    mean: float = math.nan
    level: float = math.nan
    best: float = math.nan
    jitter: float = 0.0
    last: float = math.nan
    """The last finite loss."""

    def spread(self, span: int) -> float:
        """Return the standard deviation of a running mean over ``span`` losses, by the jitter.

        Args:
            span: the running mean's span, in losses.

        Returns:
            The standard deviation.
        """
        weight = 2.0 / (span + 1)
        return self.jitter / _JITTER_PER_SIGMA * math.sqrt(weight / (2.0 - weight))

    def level_span(self, span: int) -> float:
        """Return the level's span: ``span``, lengthened until its spread is ``_LEVEL_NOISE`` of it.

        Args:
            span: the short running mean's span, in losses.

        Returns:
            The level's span, in losses (at most ``_LEVEL_SPAN_MAX``).
        """
        sigma = self.jitter / _JITTER_PER_SIGMA
        relative = sigma / abs(self.level) if self.level else 0.0
        return min(max(float(span), (relative / _LEVEL_NOISE) ** 2), _LEVEL_SPAN_MAX)

    def update_short_mean(self, x: float, span: int) -> None:
        """Fold the finite loss ``x`` into the short running mean (the rules then judge it).

        Args:
            x: the loss.
            span: the short running mean's span, in losses.
        """
        self.seen += 1
        n = self.seen
        if n == 1:
            self.first = x
            self.mean = x
            self.level = x
            self.best = x
            self.last = x
            return
        self.mean += (x - self.mean) * max(2.0 / (span + 1), 1.0 / n)

    def update_baseline(self, x: float, span: int, history: int) -> None:
        """Fold the judged loss ``x`` into the jitter, the level, the best and the start.

        Not while a setback is open: a blow-up is not the run's noise, and the bar holds still.

        Args:
            x: the loss.
            span: the short running mean's span, in losses (the level's shortest).
            history: over this many first losses the level is their mean, and the start too.
        """
        n = self.seen
        if n == 1:
            return
        self.jitter += (abs(x - self.last) - self.jitter) / min(n - 1, _JITTER_SPAN)
        self.last = x
        self.level += (x - self.level) * max(2.0 / (self.level_span(span) + 1), 1.0 / n)
        # over the first ``history`` losses the level is their mean: no single loss is a best
        self.best = self.level if n <= history else min(self.best, self.level)
        if n <= history:
            self.first += (x - self.first) / n


class _Echo(NamedTuple):
    """The echo of an outlier batch the run came back from, held for a while."""

    until_step: int
    """The last optimizer step the echo is held to."""
    outlier_loss: float
    """The outlier steps' highest mean loss: a step past it is worse than the outlier."""


class _Peak(NamedTuple):
    """The optimizer step of the run's highest mean loss so far, and that loss."""

    step: int
    loss: float


@dataclass
class _Group:
    """The losses read so far of one optimizer step (its micro-batches), and their sum."""

    losses: int = 0
    total: float = 0.0


class LossRules:
    """*loss_spike* and *diverging* on one training loss per micro-batch.

    They are evaluated on the host when its non-blocking copy is read.

    *diverging* is a small state machine over the short running mean of the loss (the *bar*
    is :meth:`_bar`; a *setback* is logged, a *diverging* is warned):

    ```text
    from       when                                               to
    healthy    the running mean passes the bar                    setback (logged)
    setback    the running mean is back under the bar             healthy (logged: recovered)
    setback    a whole step's mean loss is back under the bar     setback, its count restarted
    setback    diverge_patience steps in a row over the bar,      diverging (warned)
               or the loss past diverge_lost x the run's start
    diverging  the running mean is back under the bar             healthy
    any        a loss that is not finite                          diverging (warned)
    ```

    Once the run has learnt, a step back under the bar after one or two outlier steps holds
    their echo: for a while, the rise that follows counts toward nothing (**Outlier held**,
    below).

    In words:

    - **Healthy.** The running mean is under the bar: a rise over the best by
      ``diverge_ratio - 1`` of it, by ``diverge_giveback`` of what the run had learnt, and by
      ``diverge_noise`` spreads of the short mean's own noise.
    - **Setback** (logged, never warned). The running mean crossed the bar. From here:

      - back to *healthy* when the running mean falls under the bar first (logged as
        recovered);
      - still a setback, its count of steps over the bar started again, when one optimizer
        step's mean loss is back under the bar: the running mean remembers a bad batch for a few
        steps, the step's own mean does not;
      - to *diverging* (a warning) when ``diverge_patience`` optimizer steps in a row have a
        mean loss over the bar themselves;
      - to *diverging* when the loss passes ``diverge_lost`` times where the run started. The
        loss read is the running mean; once the run has learnt, it is the median of the last
        ``2 * diverge_patience - 1`` optimizer steps' mean losses, which fewer than
        ``diverge_patience`` outlier steps cannot move;
      - to *diverging* at once when the loss is not finite.

    - **Diverging** (warned at its confirmation; the alarm is raised again at each loss over
      the bar while it holds). Back to *healthy*, with no notice, when the running mean falls
      under the bar.
    - **Outlier held.** Once the run has learnt, a step back under the bar after one or two
      steps over it marks an outlier batch the run came back from; so does a step still over
      the bar that fell back under half the outlier steps' mean loss and under the run's start.
      For ``diverge_patience * diverge_span`` optimizer steps the rise that follows (the
      outlier's echo, which an optimizer with momentum carries on for a while) confirms
      nothing, unless a step's mean loss passes the outlier steps' own or the loss is not
      finite.

    Under gradient accumulation the callback reads every micro-batch's loss: the rule counts
    the losses of each optimizer step (:attr:`per_step`), spans its running means over
    ``diverge_span`` steps of them, and holds a setback by steps, so that one step's hard
    micro-batches, read at the same weights, are one bad step and not a divergence.

    Args:
        rules: the alarm rules and their thresholds.
        device: the device the loss lives on, copied from.

    Example:
        >>> rules = LossRules(AlarmRules(), torch.device("cpu"))
        >>> losses = [2.0, 1.6, 1.3, 1.1, 1.0, 1.0, 1.0, 4.0, 1.0, 1.0, 1.0, 1.0]
        >>> [(a.rule, a.step, a.counts) for s, x in enumerate(losses) for a in rules.evaluate(x, s)]
        [('setback', 7, True), ('setback', 8, False)]
        >>> [a.rule for a in rules.evaluate(float("nan"), 12)]
        ['diverging']
    """

    def __init__(self, rules: AlarmRules, device: torch.device) -> None:
        self.rules = rules
        self.scale = RunningScale(1, rules)
        self.spike = False
        """Whether the last loss was a *loss_spike*."""
        self.spike_scale = math.nan
        """*loss_spike*'s running scale of the loss before the last loss."""
        self.levels = LossLevels()
        self.setback: Setback | None = None
        self.per_step = 1
        """Losses read per optimizer step (its micro-batches under gradient accumulation), as
        counted on the last whole step: *diverging*'s spans are in optimizer steps, this many
        losses each."""
        self._step: int | None = None
        self._group = _Group()
        self._recent: deque[float] = deque(maxlen=2 * rules.diverge_patience - 1)
        """The mean losses of the last optimizer steps, whose median *diverging* holds to
        ``diverge_lost``."""
        self._trail: deque[tuple[int, float]] = deque(maxlen=rules.history)
        self._echo: _Echo | None = None
        """The echo of an outlier batch held (:meth:`_count_toward_patience`)."""
        self._peak = _Peak(-1, -math.inf)
        self._start = math.nan  # the first optimizer step's mean loss
        self.adaptive = False
        """The optimizer keeps a second moment: its first ``diverge_early`` losses are held to
        the ``diverge_overshoot`` bar (:meth:`TrainingAlarms.set_adaptive`)."""
        self._host_copy = HostCopy((1,), device)

    @property
    def seen(self) -> int:
        """Finite losses read so far."""
        return self.levels.seen

    @property
    def diverged(self) -> bool:
        """Whether the loss is over *diverging*'s bar now: a setback open or confirmed.

        A loss that is not finite confirms one.
        """
        return self.setback is not None

    def progress(self) -> LossProgress | None:
        """Return how far the loss has come, for *stall*.

        Returns:
            The best level and the start, once a loss was read; ``None`` before, or with
            *diverging* off.
        """
        if self.rules.diverge_ratio is None or not self.levels.seen:
            return None
        return LossProgress(self.levels.best, self.levels.first)

    def update(self, loss: torch.Tensor, step: int) -> None:
        """Post ``loss`` (a copy, no sync); :meth:`read` evaluates it.

        Args:
            loss: the training loss, a device scalar.
            step: its optimizer step, handed back with it.
        """
        # float32 on the device first: a non-blocking copy to the host does not convert
        value = loss if loss.dtype == torch.float32 else loss.float()
        # The loss arrives detached (Lightning detaches what it hands the batch-end hooks, and
        # so does the Fabric driver), so the copy records no graph.
        self._host_copy.post(value, step)

    def read(self, wait: bool) -> LossVerdict | None:
        """Evaluate the posted loss once its copy is read.

        Args:
            wait: block until the copy is read.

        Returns:
            Its step and alarms, if any; else ``None`` (also while the copy is not read).
        """
        got = self._host_copy.read(wait)
        if got is None:
            return None
        value, step = got
        alarms = self.evaluate(float(value.reshape(-1)[0]), step)
        return LossVerdict(step, alarms) if alarms else None

    def evaluate(self, x: float, step: int) -> list[TrainingAlarm]:
        """Apply the rules to the loss ``x`` of optimizer step ``step`` (the state updated).

        Args:
            x: the training loss.
            step: its optimizer step.

        Returns:
            The rules' alarms.
        """
        self._count_step(step)
        alarms = []
        if self.rules.loss_factor is not None:
            with np.errstate(all="ignore"):
                self._spike(_F(x))
            if self.spike:
                alarms.append(_loss_spike(step, x, self.spike_scale, self.rules))
        if self.rules.diverge_ratio is not None:
            alarms += self._diverging(x, step)
        return alarms

    def _count_step(self, step: int) -> None:
        """Count a loss of ``step``: the first of a new step sets :attr:`per_step` from the last."""
        if step != self._step:
            if self._step is not None:
                self.per_step = self._group.losses
            self._step = step
            self._group = _Group()
        self._group.losses += 1

    def _span(self) -> int:
        """Return the short mean's span in losses: ``diverge_span`` optimizer steps."""
        return self.rules.diverge_span * self.per_step

    def _diverging(self, x: float, step: int) -> list[TrainingAlarm]:
        """Return the setback and *diverging* alarms of the loss ``x`` (the state updated)."""
        rules = self.rules
        levels = self.levels
        if not math.isfinite(x):
            return self._confirm(step, x, "the loss is not finite")
        levels.update_short_mean(x, self._span())
        self._group.total += x
        if self._group.losses == self.per_step:  # the step's last loss: its mean is known
            self._close_step(step, self._group.total / self._group.losses)
        bar = self._bar()
        # Armed from the second loss, so that a learning rate too high is seen in its first
        # steps; until ``min_history`` losses have measured the noise, the bar has no noise margin.
        over = levels.seen > 1 and levels.mean > bar
        alarms = (
            self._over_the_bar(x, step, bar, self._step_mean()) if over else self._recover(step)
        )
        if self.setback is None:
            levels.update_baseline(x, self._span(), rules.min_history)
        else:  # the last loss is still the run's: the next jitter is measured from it
            levels.last = x
        return alarms

    def _close_step(self, step: int, mean: float) -> None:
        """Keep the mean loss of ``step``, whose last loss was just read."""
        self._recent.append(mean)
        self._trail.append((step, mean))
        if math.isnan(self._start):
            self._start = mean
        if mean > self._peak.loss:
            self._peak = _Peak(step, mean)

    def story(self) -> LossStory | None:
        """Return where the run started, its highest step and its last steps.

        Returns:
            The story, or ``None`` before the run's start is known, or with *diverging* off.
        """
        if self.rules.diverge_ratio is None or self.levels.seen < self.rules.min_history:
            return None
        peak = self._peak
        return LossStory(self._start, peak.step, peak.loss, tuple(self._trail))

    def _step_mean(self) -> float | None:
        """Return the step's mean loss, once its last loss is read.

        ``None`` before the last loss completed its optimizer step. The micro-batches of one
        step share its weights: a hard one says nothing of the update, so a setback holds by
        steps.
        """
        group = self._group
        if group.losses != self.per_step:
            return None
        return group.total / group.losses

    def _over_the_bar(
        self, x: float, step: int, bar: float, mean: float | None
    ) -> list[TrainingAlarm]:
        """Judge a running mean over the bar: a setback opened, held, or confirmed.

        A completed step under the bar starts the count again: the run came back, and what the
        running mean still remembers is the bad steps before, one or two outlier batches. Once
        the run has learnt, the outlier's echo is then held (:meth:`_count_toward_patience`).

        Args:
            x: the loss.
            step: its optimizer step.
            bar: *diverging*'s bar now.
            mean: the mean loss of the step just completed, judged against the bar itself, not
                only the running mean that remembers an earlier one (``None``: the step is not
                complete).

        Returns:
            The alarms: the setback opened, and *diverging* where it is confirmed or holds.
        """
        rules = self.rules
        levels = self.levels
        setback = self.setback
        opened = []
        if setback is None:
            setback = Setback(step, levels.best, levels.mean)
            self.setback = setback
            opened = [setback_opened(step, setback, levels.mean, levels.first, rules)]
        echo_held = self._count_toward_patience(setback, step, bar, mean)
        setback.peak = max(setback.peak, levels.mean)
        if setback.confirmed:
            return [self._diverging_alarm(step, x, "it holds")]
        if echo_held:
            return opened
        if setback.steps >= rules.diverge_patience:
            why = (
                f"the loss has stayed over the bar for {setback.steps} optimizer steps "
                f"(diverge_patience={rules.diverge_patience})"
            )
            return opened + self._confirm(step, x, why)
        # the run's start (:attr:`LossLevels.first`) is known once ``min_history`` losses are in
        started = levels.seen > rules.min_history
        lost_bar = rules.diverge_lost * levels.first + self._noise_bar()
        if started and self._has_learnt() and self._recent:
            median = float(np.median(self._recent))
            if median > lost_bar:
                why = (
                    f"the median loss of its last {len(self._recent)} optimizer steps is past "
                    f"diverge_lost={rules.diverge_lost:g}x the run's start"
                )
                return opened + self._confirm(step, x, why)
        elif started and levels.mean > lost_bar:
            why = f"its running mean is past diverge_lost={rules.diverge_lost:g}x the run's start"
            return opened + self._confirm(step, x, why)
        return opened

    def _count_toward_patience(
        self, setback: Setback, step: int, bar: float, mean: float | None
    ) -> bool:
        """Count the step just completed toward the setback; return whether an echo holds.

        A step over the bar counts, one under it starts the count again. A run that has learnt
        and comes back under the bar after fewer than ``diverge_patience`` steps over it, or
        falls back from them (:meth:`_falls_back`), met one or two outlier batches: for
        ``diverge_patience * diverge_span`` optimizer steps after it came back
        (:meth:`_outlier_hold_steps`), the rise that follows (an optimizer with momentum carries the
        outlier's update on for a while) counts toward nothing, unless a step's mean loss passes
        the outlier steps' own, which an echo does not.

        Args:
            setback: the open setback.
            step: the optimizer step of the loss just read.
            bar: *diverging*'s bar now.
            mean: the mean loss of the step just completed (``None``: the step is not complete).

        Returns:
            Whether the echo of an outlier batch holds at ``step``: nothing confirms the
            setback but a loss that is not finite.
        """
        echo = self._echo
        past = echo is not None and step > echo.until_step
        worse = echo is not None and mean is not None and mean > echo.outlier_loss
        if past or worse:
            echo = None  # over, or a step worse than the outlier itself: no echo
            self._echo = None
        if mean is None:
            return echo is not None
        if echo is not None:  # the echo's steps count toward nothing
            setback.steps = 0
            return True
        if mean > bar and not self._falls_back(setback, mean):
            setback.steps += 1
            setback.jump = max(setback.jump, mean)
            return False
        if setback.steps and self._has_learnt():
            self._echo = _Echo(step + self._outlier_hold_steps(), setback.jump)
            setback.steps = 0
            return True
        setback.steps = 0
        return False

    def _falls_back(self, setback: Setback, mean: float) -> bool:
        """Return whether a step over the bar falls back from the outlier steps before it.

        Once the run has learnt, after one or two steps over the bar, a step whose mean loss is
        under :data:`_FALLS_BACK` of theirs, and under where the run started, came back from
        them, even where the outlier's damage (a batch of wrong labels, say) keeps it over the
        bar a while: it starts the outlier's echo as a step back under the bar does. A
        divergence climbs, holds its level, or loses all the run had learnt.

        Args:
            setback: the open setback, whose ``steps`` and ``jump`` are the steps over the bar
                so far and their highest mean loss.
            mean: the mean loss of the step just completed, over the bar.

        Returns:
            Whether the step falls back from the outlier steps before it.
        """
        outlier_steps = 0 < setback.steps < self.rules.diverge_patience
        kept = mean < self.levels.first  # not all it had learnt lost
        return outlier_steps and kept and mean < _FALLS_BACK * setback.jump and self._has_learnt()

    def _outlier_hold_steps(self) -> int:
        """Return the optimizer steps an outlier batch's echo is held after the run came back.

        ``diverge_patience`` spans of the short running mean (``diverge_span`` steps each): 12
        at the defaults, past the 10 steps over which momentum 0.9 carries an update on.
        """
        return self.rules.diverge_patience * self.rules.diverge_span

    def _has_learnt(self) -> bool:
        """Return whether the run has learnt: its best is under :data:`_LEARNT` of its start.

        Such a run meets an outlier batch now and then, and one or two cannot move the median
        its ``diverge_lost`` bar holds; a run that has not learnt yet has nothing to lose to one
        batch, and a jump there is the first sign of a learning rate too high.
        """
        levels = self.levels
        return levels.best < _LEARNT * levels.first if levels.first > 0 else False

    def _noise_bar(self) -> float:
        """Return how far the short mean wanders from noise alone.

        ``diverge_noise`` of its spreads, once ``min_history`` losses have measured the noise.
        """
        if self.levels.seen < self.rules.min_history:
            return 0.0
        return self.rules.diverge_noise * self.levels.spread(self._span())

    def _bar(self) -> float:
        """Return *diverging*'s bar: the level over which the short running mean is a setback."""
        rules = self.rules
        levels = self.levels
        best = levels.best
        learnt = max(levels.first - best, 0.0)
        early = self.adaptive and levels.seen <= rules.diverge_early * self.per_step
        assert rules.diverge_ratio is not None
        ratio = (rules.diverge_overshoot if early else rules.diverge_ratio) - 1.0
        return best + max(ratio * abs(best), rules.diverge_giveback * learnt) + self._noise_bar()

    def _confirm(self, step: int, x: float, why: str) -> list[TrainingAlarm]:
        """Confirm *diverging* at ``step``: the open setback (if any) confirmed, ``why`` said."""
        setback = self.setback
        if setback is not None and setback.confirmed:
            return [self._diverging_alarm(step, x, "it holds")]
        if setback is None:
            setback = Setback(step, self.levels.best, self.levels.mean)
            self.setback = setback
        setback.confirmed = True
        return [self._diverging_alarm(step, x, why, setback)]

    def _diverging_alarm(
        self, step: int, x: float, why: str, setback: Setback | None = None
    ) -> TrainingAlarm:
        """Write *diverging*'s alarm: the rise confirmed (``why``) and where the loss stands.

        ``setback``: the setback it confirms, named at its confirmation; without it, the
        divergence holds.
        """
        rules = self.rules
        said = (
            self._holds(step, x, why) if setback is None else self._confirms(step, x, why, setback)
        )
        thresholds = (
            f"diverge_ratio={rules.diverge_ratio}, diverge_patience={rules.diverge_patience}, "
            f"diverge_lost={rules.diverge_lost:g}"
        )
        details = (*said.details, thresholds)
        best = self.levels.best
        return TrainingAlarm("diverging", "loss", step, x, best, said.first, details=details)

    def _confirms(self, step: int, x: float, why: str, setback: Setback) -> Message:
        """Return the text of *diverging* when it confirms ``setback``.

        Its running mean against its best, and why it is confirmed.
        """
        levels = self.levels
        first = f"loss diverging at optimizer step {step}: the loss is {x}"
        if math.isfinite(x):
            first = (
                f"loss diverging at optimizer step {step}: its running mean {levels.mean:.4g} is "
                f"{_over(levels.mean, levels.best)} its best {levels.best:.4g}"
            )
        confirmed = f"the setback of optimizer step {setback.start} is confirmed: {why}"
        where = f"this step's loss {x:.4g}; the run started at {levels.first:.4g}"
        return Message(first, (confirmed, where))

    def _holds(self, step: int, x: float, why: str) -> Message:
        """Return the text of *diverging* at a later step while the divergence holds.

        This step's loss against the best, and since when; not the running mean, which may
        still remember a blow-up long past.
        """
        levels = self.levels
        since = "" if self.setback is None else f", diverging since step {self.setback.start}"
        first = f"loss diverging at optimizer step {step}: the loss is {x}{since}"
        if math.isfinite(x):
            first = (
                f"loss diverging at optimizer step {step}: loss {x:.4g} is "
                f"{_over(x, levels.best)} its best {levels.best:.4g}{since}"
            )
        held = f"{why}: its running mean {levels.mean:.4g} is still over diverging's bar"
        return Message(first, (held,))

    def _recover(self, step: int) -> list[TrainingAlarm]:
        """Close the open setback, if any, at ``step``: a recovery when it was not confirmed."""
        setback = self.setback
        self.setback = None
        if setback is None or setback.confirmed:
            return []
        return [setback_recovered(step, setback, self.levels.mean)]

    def _spike(self, x: np.float32) -> None:
        """Set *loss_spike*'s flag and running scale (the scale updated)."""
        assert self.rules.loss_factor is not None
        log_loss = np.log(np.array([x], dtype=np.float32))
        (ceiling,) = self.scale.thresholds(self.rules.loss_factor).ceilings
        positive = np.abs(log_loss) < math.inf
        self.spike = bool((positive & (log_loss > ceiling))[0])
        self.spike_scale = float(np.exp(self.scale.mean[0]))
        self.scale.update(log_loss, positive, ceiling)

    def state_dict(self) -> dict[str, Any]:
        """Return the loss rules' state, for a checkpoint.

        Returns:
            The running scale, *diverging*'s levels, the open setback, the last steps' mean
            losses, the losses read per optimizer step and of the last step, and the run's
            first and highest step and its trail of steps that the messages quote, by name.
        """
        return {
            "loss_scale": torch.from_numpy(self.scale.state.copy()),
            "loss_levels": asdict(self.levels),
            "loss_setback": None if self.setback is None else asdict(self.setback),
            "loss_recent": list(self._recent),
            "loss_echo": None if self._echo is None else list(self._echo),
            "loss_per_step": self.per_step,
            "loss_step": self._step,
            "loss_group": [self._group.losses, self._group.total],
            "loss_start": self._start,
            "loss_peak": list(self._peak),
            "loss_trail": [list(point) for point in self._trail],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Args:
            state: what :meth:`state_dict` returned, among the alarms' other entries, in the
                current format (:func:`~lightning_hooks.core.alarms.saved_state.upgrade`).
        """
        self.scale.load(state["loss_scale"])
        self.levels = LossLevels(**state["loss_levels"])
        setback = state["loss_setback"]
        self.setback = None if setback is None else Setback(**setback)
        self._recent.clear()
        self._recent.extend(state["loss_recent"])
        echo = state["loss_echo"]
        self._echo = None if echo is None else _Echo(int(echo[0]), float(echo[1]))
        self.per_step = int(state["loss_per_step"])
        step = state["loss_step"]
        self._step = None if step is None else int(step)
        losses, total = state["loss_group"]
        self._group = _Group(int(losses), float(total))
        self._start = float(state["loss_start"])
        peak = state["loss_peak"]
        self._peak = _Peak(int(peak[0]), float(peak[1]))
        self._trail.clear()
        self._trail.extend((int(s), float(m)) for s, m in state["loss_trail"])


def _loss_spike(step: int, value: float, scale: float, rules: AlarmRules) -> TrainingAlarm:
    """Write *loss_spike*'s alarm: the loss against its running scale."""
    text = (
        f"loss spike at optimizer step {step}: loss {value:.4g} is {value / scale:.3g}x its "
        f"running scale {scale:.4g}"
    )
    details = (f"loss_factor={rules.loss_factor}, spike_sigmas={rules.spike_sigmas}",)
    return TrainingAlarm("loss_spike", "loss", step, value, scale, text, details=details)


def _over(value: float, best: float) -> str:
    """Return how far ``value`` is over ``best``.

    A ratio (``3.2x``), or the difference when the best is not positive.
    """
    return ratio_text(value / best) if best > 0 else f"+{value - best:.4g} over"
