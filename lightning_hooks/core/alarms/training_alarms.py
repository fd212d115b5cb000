"""`TrainingAlarms`: the alarm rules run at every optimizer step (no Lightning).

The device posts a non-blocking copy of the gradient norms (and the loss) to host memory, and
the rules and any diagnosis run on the host when it is read: no read of a device value and no
kernel on a quiet step. On CUDA each step first waits for the copy its previous step posted
(its event), which the device has finished unless the host runs more than a step ahead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any, NamedTuple

import numpy as np
import torch

from lightning_hooks.core.alarms.advice import Evidence, advise
from lightning_hooks.core.alarms.attention import attention_alarms
from lightning_hooks.core.alarms.gradients import (
    DEAD_STEPS,
    GradientReport,
    GradientRules,
    HostSegments,
    as_array,
)
from lightning_hooks.core.alarms.loss import LossRules
from lightning_hooks.core.alarms.messages import (
    FiredStep,
    NormHistory,
    TrainingAlarm,
    gradient_alarm,
    weight_norms,
    with_dead_network_story,
    with_fixes,
    with_history,
)
from lightning_hooks.core.alarms.rules import ALARM_RULES, AlarmRules, WeightNorms
from lightning_hooks.core.alarms.run_facts import RunFacts
from lightning_hooks.core.alarms.saved_state import STATE_VERSION, VERSION, upgrade
from lightning_hooks.core.alarms.stall import StallRule
from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.host_copy import HostCopy

__all__ = ["NormRing", "PostedStep", "TrainingAlarms"]


class PostedStep(NamedTuple):
    """What :meth:`TrainingAlarms.update` posts beside a step's norms.

    It comes back with them when the host reads the copy.
    """

    step: int
    """The optimizer step."""
    order: tuple[int, ...]
    """Layer rows in the order their output-gradient hooks fired, each once."""
    rows: np.ndarray | None
    """The rows the norms cover (``None``: all)."""
    weights: WeightNorms | None
    """The weight norms of ``rows``, read when *nonfinite* fired."""
    clip: float | None
    """The largest global L2 norm the optimizer will apply, for *explosion*."""
    amp: bool
    """A GradScaler is active: non-finite gradients are an overflow it skips."""
    segments: HostSegments | None
    """Set when the norms are per parameter: how they fold into rows on the host."""


@named_arguments
class TrainingAlarms:
    """Evaluates :class:`AlarmRules` on the host, on rows that are the layers, then ``"global"``.

    :meth:`update` feeds the gradient rules, :meth:`update_loss` the loss rules,
    :meth:`update_stall` and :meth:`update_attention` *stall* and *attention* on logging steps.
    :meth:`poll` returns the verdicts: at once on the CPU; on CUDA when the copy is done, at the
    latest one step late (or with ``wait=True``).

    Args:
        layers: row names: the layers, then ``"global"``.
        rules: the rules and thresholds.
        device: where the statistics live.

    Raises:
        TypeError: ``rules`` is neither an :class:`AlarmRules` nor ``None``.

    Example:
        >>> alarms = TrainingAlarms(["a", "b", "global"], AlarmRules(min_history=3))
        >>> norms = [[1.0, 2.0, 2.2], [1.1, 2.1, 2.4], [0.9, 1.9, 2.1], [1.0, 200.0, 200.0]]
        >>> for step, norm in enumerate(norms):
        ...     alarms.update(torch.tensor(norm), step=step)
        >>> [(a.rule, a.layer, a.step, a.others) for a in alarms.poll()]
        [('spike', 'b', 3, ('global',))]
        >>> alarms.counts["spike"]
        2
    """

    def __init__(
        self,
        layers: Sequence[str],
        rules: AlarmRules | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.layers = tuple(layers)
        self.rules = rules if rules is not None else AlarmRules()
        if not isinstance(self.rules, AlarmRules):
            raise TypeError(f"TrainingAlarms(rules={rules!r}): must be an AlarmRules or None")
        self._watches_loss = self.rules.watches_loss  # read every batch; the rules are frozen
        device = torch.device(device if device is not None else "cpu")
        n = len(self.layers)
        self._gradients = GradientRules(n, self.rules)
        self._ring = NormRing(self.rules.history, n)
        self._host_copy = HostCopy((2, n), device)
        self._cuda = device.type == "cuda"
        self._loss = LossRules(self.rules, device)
        self._stall = StallRule(self.rules, device)
        self._stall_posted = False  # a quiet step reads no stall: it is posted on logging steps
        self.evaluated = 0
        """Optimizer steps the rules were evaluated on, since construction."""
        self.total = 0
        """Alarms since construction (every rule, transient spikes included)."""
        self.counts: dict[str, int] = dict.fromkeys(ALARM_RULES, 0)
        """Flagged (layer, step) pairs per rule since :meth:`take_epoch`, on the host."""
        self.log: list[TrainingAlarm] = []
        """Every alarm since :meth:`take_epoch`, one per rule and step."""
        self._new: list[TrainingAlarm] = []
        self._logits: dict[str, list[float]] = {}  # the attention logits of the last logging steps
        self.facts = RunFacts()
        """What the alarms may quote of the run: the learning rate, the output layer's units
        (:meth:`set_run_facts`)."""

    def set_run_facts(self, facts: RunFacts) -> None:
        """Quote ``facts`` in the alarms.

        The learning rate where the fix is to lower it, and ``ln C`` beside the loss of a dead
        network.

        Args:
            facts: what the alarms may quote of the run (``RunFacts.of(model, optimizers)``).
        """
        self.facts = facts

    @torch.no_grad()
    def update(  # noqa: PLR0913 (one optimizer step's facts, on the quiet step's path: no record built per step)
        self,
        norm: torch.Tensor,
        rows: Sequence[int] | torch.Tensor | None = None,
        *,
        step: int,
        amp: bool = False,
        order: Sequence[int] = (),
        weights: WeightNorms | None = None,
        stepped: torch.Tensor | None = None,
        clip: float | None = None,
        segments: HostSegments | None = None,
    ) -> None:
        """Post one optimizer step's norms to the host for the gradient rules.

        On CUDA it first reads the previous step's copy, waiting for it if the device has not
        finished it; the copy posted now is read at the next step.

        Args:
            norm: ``[len(rows)]`` gradient L2 norms, last the global one (of a table: column 0).
            rows: the rows ``norm`` covers (default: all), best on the host (a device tensor is
                read once: a sync). When not every layer, the global row is out of the rules.
            step: the optimizer step, for the messages.
            amp: a GradScaler is active: non-finite gradients are an overflow it skips.
            order: layer rows in the order their output-gradient hooks fired.
            weights: the weight norms of ``rows``, called when a rule fired (*nonfinite*).
            stepped: ``[len(rows)]`` bool, false for a layer with no gradient (out of the rules).
            clip: the largest global L2 norm the optimizer will apply, for *explosion*.
            segments: ``norm`` is ``[parameters]`` L2 norms, folded into ``rows`` on the host.
        """
        self._read_arrived(wait=True)  # the previous step's verdict: at most one step late
        self.evaluated += 1
        norm = (norm[:, 0] if norm.dim() == 2 else norm).float()  # GradFlowTracker's: float32
        host_rows = self._gradients.host_rows(rows)
        # one copy: the norms, with the stepped rows beside them only when some were not
        value = norm if stepped is None else torch.stack([norm, stepped.float()])
        once = tuple(dict.fromkeys(order))  # a layer whose hook fired twice: its first time
        self._host_copy.post(value, PostedStep(step, once, host_rows, weights, clip, amp, segments))
        if not self._cuda:  # the copy was the read: diagnose now, while the weights are these
            self._read_arrived(wait=False)

    def reserve(self, parameters: int) -> None:
        """Make the host copy of ``parameters`` norms ready for :meth:`update`'s ``segments``.

        Args:
            parameters: the number of per-parameter norms :meth:`update` will post.
        """
        self._host_copy.reserve((parameters,))

    def set_adaptive(self, value: bool) -> None:
        """Set whether the optimizer keeps a second moment (Adam, RMSprop, ...).

        If it does, *diverging* holds its first ``diverge_early`` losses to
        ``diverge_overshoot`` (an ``AlarmFeed`` sets it at its first steps).

        Args:
            value: whether the optimizer is adaptive.
        """
        self._loss.adaptive = bool(value)

    @torch.no_grad()
    def update_loss(self, loss: torch.Tensor, *, step: int) -> None:
        """Apply *loss_spike* and *diverging* to one training loss.

        The verdict is read at most one step late: on CUDA this first waits for the previous
        step's copy, if the device has not finished it.

        Args:
            loss: the training loss, a device scalar.
            step: its optimizer step.
        """
        if not self._watches_loss:
            return
        self._read_arrived_loss(wait=True)  # also counts the finite losses seen so far
        self._loss.update(loss, step)
        if not self._cuda:
            self._read_arrived_loss(wait=False)

    @torch.no_grad()
    def update_stall(self, update: torch.Tensor, lr: float, *, step: int) -> None:
        """Apply *stall* at a logging step, read at the next poll.

        Skipped while ``lr`` is under 1% of its peak.

        Args:
            update: a weight's typical change, a device scalar, judged per unit of ``lr``.
            lr: the learning rate of this step.
            step: the optimizer step.
        """
        if not self._stall.due(lr):
            return
        self._read_arrived_stall(wait=True)
        self._read_arrived_loss(wait=True)  # the loss's state as of this step
        self._stall.update(update, lr, step, self._loss.progress())
        self._stall_posted = True
        if not self._cuda:
            self._read_arrived_stall(wait=False)

    def update_attention(
        self, logit_max: Mapping[str, float], entropy_min: Mapping[str, float], *, step: int
    ) -> None:
        """Apply *attention* to a logging step's attention statistics.

        Host values, reduced across ranks: every rank reads the same alarms.

        Args:
            logit_max: each attention layer's largest attention logit.
            entropy_min: each attention layer's most focused head's mean entropy, in nats.
            step: the optimizer step.
        """
        history = self._logits
        for alarm in attention_alarms(logit_max, entropy_min, step, self.rules, history):
            self._record(alarm)
        for layer, peak in logit_max.items():
            history[layer] = [*history.get(layer, [])[-1:], float(peak)]

    @property
    def spike_score(self) -> float:
        """Alarms per 1,000 evaluated optimizer steps since construction.

        Every rule, transient spikes included, as OLMo-core's ``SpikeScore``.
        """
        return 1000.0 * self.total / max(self.evaluated, 1)

    def poll(self, wait: bool = False) -> list[TrainingAlarm]:
        """Return the alarms read on the host since the last poll.

        Args:
            wait: block until the latest step's copy is read, to include it.

        Returns:
            The new alarms, in the order they were read.
        """
        self._read_arrived(wait)
        new = self._new
        self._new = []
        return new

    def _read_arrived_loss(self, wait: bool) -> None:
        """Record the loss rules' alarms once the posted loss is read (``wait``: block)."""
        verdict = self._loss.read(wait)
        if verdict is None:
            return
        history = self._ring.read(verdict.step)
        for alarm in verdict.alarms:
            self._record(with_history(alarm, self.layers, history))

    def _read_arrived_stall(self, wait: bool) -> None:
        """Record *stall*'s alarm once the posted update is read (``wait``: block)."""
        if not self._stall_posted:
            return
        alarm = self._stall.read(wait)
        if alarm is None and not wait:
            return  # its copy is not read yet: it is still posted
        self._stall_posted = False
        if alarm is not None:
            self._record(alarm)

    def _read_arrived(self, wait: bool) -> None:
        """Read every posted copy and run its rules (``wait``: block until each is read)."""
        self._read_arrived_loss(wait)
        self._read_arrived_stall(wait)
        got = self._host_copy.read(wait)
        if got is None:
            return
        value, posted = got
        segments = posted.segments
        folded = value if segments is None else segments.fold(value)  # per parameter: a row each
        report = self._gradients.read(folded, posted.rows, posted.amp, posted.clip)
        self._ring.write(posted.step, report.traced)
        if not report.flags.any():  # no rule fired (a quiet step's report too)
            return
        self._diagnose(report, posted)

    def _diagnose(self, report: GradientReport, posted: PostedStep) -> None:
        """Record the alarms of the rules that fired, with the ring buffer's history."""
        layers = self.layers
        weights = None
        if report.fired("nonfinite").any():
            weights = weight_norms(posted.weights, posted.rows, len(layers))
        at = FiredStep(posted.step, posted.order, posted.clip, weights)
        history = self._ring.read(posted.step)
        scale = float(report.scale[-1])
        for rule in report.fired_rules():
            alarm = gradient_alarm(rule, report, at, layers, self.rules)
            self._record(with_history(alarm, layers, history), scale)

    def _record(self, alarm: TrainingAlarm, global_scale: float = math.nan) -> None:
        """Count ``alarm`` and keep it, its text completed with its fixes.

        The fixes come in the order the run's evidence says (``global_scale``: the global norm's
        running scale, for a clip).
        """
        if alarm.network_cut:
            alarm = self._dead_network_story(alarm)
        evidence = Evidence(
            self._loss.diverged,
            global_scale,
            network_cut=alarm.network_cut,
            learning_rate=self.facts.learning_rate(),
        )
        alarm = with_fixes(alarm, advise(alarm.rule, evidence))
        if alarm.counts:
            self.counts[alarm.rule] += 1 + len(alarm.others)
            self.total += 1
        self.log.append(alarm)
        self._new.append(alarm)

    def _dead_network_story(self, alarm: TrainingAlarm) -> TrainingAlarm:
        """Add to a dead network's alarm what the loss did since the death began.

        Against the loss of a uniform guess where the output layer is known, and its jump
        before.
        """
        facts = self.facts
        chance = None if facts.classes is None else (facts.classes, facts.chance_loss)
        story = self._loss.story()
        if story is None:
            return with_dead_network_story(alarm, [], "", chance)
        since = alarm.step - DEAD_STEPS + 1
        jump = ""
        if story.peak_step < since and story.start > 0 and story.peak > 2.0 * story.start:
            jump = (
                f"before it, the loss jumped to {story.peak:.4g} at step {story.peak_step} (the "
                f"run started at {story.start:.4g}): a step too large for the learning rate"
            )
        return with_dead_network_story(alarm, story.since(since), jump, chance)

    def take_epoch(self) -> tuple[dict[str, int], list[TrainingAlarm]]:
        """Return the counts and alarms since the last call (waits for the latest step), then reset.

        Returns:
            The flagged (layer, step) pairs per rule, and every alarm, since the last call.
        """
        self._read_arrived(wait=True)
        counts = self.counts
        log = self.log
        self.counts = dict.fromkeys(ALARM_RULES, 0)
        self.log = []
        return counts, log

    def state_dict(self) -> dict[str, Any]:
        """Return the state a checkpoint holds, on the host.

        Returns:
            The running scales, vanishing counters, ring buffer, counts and the epoch's alarms
            (each a dict of its fields, without the ring buffer's history it quotes, which
            would make a checkpoint grow with every alarm), by name, with the layers they are
            of and the format's version under ``"version"``.
        """
        self._read_arrived(wait=True)
        return {
            VERSION: STATE_VERSION,
            "layers": self.layers,
            **self._gradients.state_dict(),
            **self._loss.state_dict(),
            **self._stall.state_dict(),
            **self._ring.state_dict(),
            "counts": dict(self.counts),
            "log": [asdict(_without_history(alarm)) for alarm in self.log],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`, whole or not at all; the layers must match this instance's.

        A state saved without a version (release 0.2.0's, or the layout saved after it) is
        first upgraded to the current format
        (:func:`~lightning_hooks.core.alarms.saved_state.upgrade`).
        A state that fails part way (a value missing or of the wrong type) leaves this instance
        as it was, and the error goes on.

        Args:
            state: what :meth:`state_dict` returned, in this release or an earlier one.

        Raises:
            ValueError: the saved layers differ from this instance's, or the state is older
                than release 0.2.0, or of a version this release does not read.
        """
        if tuple(state["layers"]) != self.layers:
            raise ValueError(
                f"TrainingAlarms.load_state_dict: saved layers {tuple(state['layers'])!r} differ "
                f"from this model's {self.layers!r}"
            )
        current = upgrade(state)
        before = self.state_dict()
        try:
            self._load(current)
        except Exception:
            self._load(before)
            raise

    def _load(self, state: Mapping[str, Any]) -> None:
        """Load each part of a state in the current format."""
        self._gradients.load_state_dict(state)
        self._loss.load_state_dict(state)
        self._stall.load_state_dict(state)
        self._ring.load_state_dict(state)
        self.counts = {**dict.fromkeys(ALARM_RULES, 0), **dict(state["counts"])}
        self.log = [TrainingAlarm(**alarm) for alarm in state["log"]]


def _without_history(alarm: TrainingAlarm) -> TrainingAlarm:
    """Return ``alarm`` without the ring buffer's steps it quotes."""
    return replace(alarm, history_steps=(), history=(), history_scale=(), history_layers=())


class NormRing:
    """The last ``size`` steps' ``[3, rows]`` of every row, and their steps, in host memory.

    Each step keeps the norm, the running scale and the half-width of the spike band in log.

    Args:
        size: how many steps the ring keeps.
        rows: the number of rows (the layers, then the global row).
    """

    def __init__(self, size: int, rows: int) -> None:
        self.ring = np.full((size, 3, rows), np.nan, dtype=np.float32)
        self.steps = [-1] * size

    def write(self, step: int, rows: np.ndarray) -> None:
        """Keep ``rows`` as ``step``'s.

        Args:
            step: the optimizer step.
            rows: ``[3, rows]``: the norm, running scale and band of every row.
        """
        slot = step % len(self.steps)
        self.ring[slot] = rows
        self.steps[slot] = step

    def read(self, step: int) -> NormHistory:
        """Return the buffer up to ``step``, oldest first.

        Args:
            step: the last optimizer step returned.

        Returns:
            The steps kept up to ``step``, and their rows.
        """
        ring = self.ring
        slots = sorted(
            (s, i) for i, s in enumerate(self.steps) if 0 <= s <= step and step - s < len(ring)
        )
        return NormHistory([s for s, _ in slots], ring[[i for _, i in slots]])

    def state_dict(self) -> dict[str, Any]:
        """Return the ring and its steps, for a checkpoint.

        Returns:
            ``{"ring": ..., "ring_steps": ...}``, on the host.
        """
        return {"ring": torch.from_numpy(self.ring.copy()), "ring_steps": list(self.steps)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` when its size is this buffer's (else it starts empty).

        Args:
            state: what :meth:`state_dict` returned.
        """
        if tuple(state["ring"].shape) == self.ring.shape:
            self.ring[...] = as_array(state["ring"])
            self.steps = list(state["ring_steps"])
