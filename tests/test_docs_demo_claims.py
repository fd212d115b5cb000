"""The story of ``./dev demo`` in docs/demo.md, sentence by sentence, against its event files.

The demo runs once per session (``examples/demo.py`` in-process, both runs, three epochs); each
test quotes one claim of docs/demo.md (it must appear there verbatim, so the page and the test
change together) and checks it on the scalars read back from the event files with TensorBoard's own
reader, independently of the library's report.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import runpy
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_hooks.tags import ALARM_STEP_TEXT, ALARM_TEXT

from conftest import read_image_tags, read_scalars
from tensorboard_server import charts, read_layouts

ROOT = Path(__file__).resolve().parents[1]
STORY = (ROOT / "docs" / "demo.md").read_text()
LAYERS = [
    "features.0",
    "features.1",
    "features.3",
    "features.4",
    "features.7",
    "features.8",
    "classifier.1",
    "classifier.3",
]
Scalars = dict[str, list[tuple[int, float]]]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The demo's log directory and what it printed."""
    logdir = tmp_path_factory.mktemp("demo") / "runs"
    module = runpy.run_path(str(ROOT / "examples" / "demo.py"), run_name="demo")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        module["main"](["--logdir", str(logdir)])
    return logdir, printed.getvalue()


def _run(demo: tuple[Path, str], name: str) -> Scalars:
    return read_scalars(demo[0] / name)


def _claim(sentence: str) -> None:
    assert sentence in " ".join(STORY.split()), f"docs/demo.md no longer says: {sentence!r}"


def _per_epoch(scalars: Scalars, tag: str) -> list[float]:
    return [value for _, value in scalars[tag]]


def test_healthy_learns_with_gradient_in_every_layer(demo: tuple[Path, str]) -> None:
    _claim("`runs/healthy` reaches about 98% validation accuracy")
    _claim("every one of its 8 layers passes a gradient in every epoch and no alarm fires")
    healthy = _run(demo, "healthy")
    assert _per_epoch(healthy, "val/acc")[-1] >= 0.95
    layers = {t.rsplit("/", 1)[1] for t in healthy if t.startswith("grad_flow/grad_norm/")}
    assert sorted(layers) == sorted(LAYERS)
    for layer in LAYERS:
        norms = _per_epoch(healthy, f"grad_flow/grad_norm/{layer}")
        assert len(norms) == 3 and all(n > 0 for n in norms), layer
    counts = [v for t, e in healthy.items() if "/alarms/" in t or "/notices/" in t for _, v in e]
    assert counts and sum(counts) == 0


def test_broken_explodes_at_single_steps_of_its_first_epoch(demo: tuple[Path, str]) -> None:
    _claim("In its first epoch the gradients explode at single steps")
    _claim("the global gradient norm of a logging step jumps to over 100x its median")
    _claim("`spike` alarms fire in its first two epochs (most of them in its first)")
    broken = _run(demo, "broken")
    steps = broken["grad_flow/global/grad_norm_step"]
    median = float(np.median([v for _, v in steps]))
    ends = [s for s, _ in broken["grad_flow/global/grad_norm"]]  # each epoch's last step
    exploded = [s for s, v in steps if v > 100 * median]
    assert exploded and all(s < ends[0] for s in exploded), exploded
    spikes = _per_epoch(broken, "grad_flow/notices/spike")
    assert spikes[0] > sum(spikes) / 2 and spikes[1] > 0 and spikes[2] == 0, spikes


def test_broken_has_no_gradient_but_in_its_output_layer_in_its_last_epoch(
    demo: tuple[Path, str],
) -> None:
    _claim("In its third epoch the gradient is gone")
    _claim("every layer but the output layer `classifier.3` gets exactly zero gradient")
    broken = _run(demo, "broken")
    for layer in LAYERS[:-1]:
        for stat in ("grad_norm", "grad_abs_mean", "grad_abs_max"):  # the chart, the heatmap
            assert _per_epoch(broken, f"grad_flow/{stat}/{layer}")[-1] == 0.0, (layer, stat)
        assert _per_epoch(broken, f"grad_flow/grad_norm/{layer}")[0] > 0, "alive at the start"
    assert _per_epoch(broken, "grad_flow/grad_norm/classifier.3")[-1] > 0
    assert {"grad_flow/chart", "grad_flow/heatmap"} <= set(read_image_tags(demo[0] / "broken"))


def test_broken_relus_are_dead_and_it_guesses(demo: tuple[Path, str]) -> None:
    _claim("`classifier.2`, the ReLU before the output layer, has every unit dead")
    _claim("ends near chance, about 10% validation accuracy")
    broken = _run(demo, "broken")
    assert _per_epoch(broken, "dead_relu/dead_fraction/classifier.2")[-1] == 1.0
    assert _per_epoch(broken, "val/acc")[-1] <= 0.15


def test_broken_dead_network_is_named_at_once_with_the_learning_rate(
    demo: tuple[Path, str],
) -> None:
    _claim("Its network is dead from the start: `vanishing` names it at optimizer step 4")
    _claim("`classifier.1` and every layer before it with no gradient since step 0")
    _claim("gives a lower learning rate as the fix")
    broken = _run(demo, "broken")
    zero = [n for n in LAYERS if _per_epoch(broken, f"grad_flow/grad_norm/{n}")[-1] == 0.0]
    assert len(zero) == 7, zero
    assert _per_epoch(broken, "grad_flow/alarms/vanishing")[0] == 1.0  # named once in epoch 0
    printed = demo[1].splitlines()
    at = next(i for i, line in enumerate(printed) if "[vanishing]" in line)
    assert (
        "dead network at optimizer step 4: classifier.1 and every layer before it get no "
        "gradient since step 0; fix: lower the learning rate (10x)"
    ) in printed[at], printed[at]
    healthy = _run(demo, "healthy")
    assert sum(_per_epoch(healthy, "grad_flow/alarms/vanishing")) == 0


def test_the_report_names_the_warnings_and_the_notices(demo: tuple[Path, str]) -> None:
    _claim("the report's last two lines for it count the warnings and the notices:")
    broken = _run(demo, "broken")
    warned = {
        rule: math.fsum(_per_epoch(broken, f"grad_flow/alarms/{rule}"))
        for rule in ("diverging", "explosion", "vanishing")
    }
    noticed = {
        column: math.fsum(_per_epoch(broken, f"grad_flow/notices/{rule}"))
        for rule, column in (("setback", "setbacks"), ("spike", "spikes"))
    }
    assert warned["diverging"] > 0  # the loss the broken run loses, warned
    lines = (
        "warnings: " + ", ".join(f"grad_flow/alarms/{r}={v:g}" for r, v in warned.items()),
        "notices: " + ", ".join(f"{c}={v:g}" for c, v in noticed.items()),
    )
    summary = demo[1].split("== summary")[1]
    assert all(line in summary for line in lines), lines
    # docs/demo.md quotes the lines of one run: the same rules, each counted or not as here (the
    # broken run is chaotic, and another CPU's floating-point bits count other numbers)
    story = " ".join(STORY.split())
    quoted = re.search(r"`(warnings: [^`]*)` and `(notices: [^`]*)`", story)
    assert quoted is not None, "docs/demo.md quotes the report's warnings and notices lines"
    documented = dict(re.findall(r"grad_flow/alarms/(\w+)=([\d.]+)", quoted.group(1)))
    documented.update(re.findall(r"(\w+)=([\d.]+)", quoted.group(2)))
    counts = {**warned, **noticed}
    assert documented.keys() == counts.keys()
    assert {r for r, v in documented.items() if float(v) > 0} == {r for r, v in counts.items() if v}


def test_the_dashboard_shows_per_step_curves_and_alarms_before_the_epoch_ends(
    demo: tuple[Path, str],
) -> None:
    _claim("each statistic's epoch chart (`grad_norm`) is followed by its chart of the logging")
    _claim("their text reaches TensorBoard at the next logging step")
    broken = demo[0] / "broken"
    titles = list(charts(read_layouts(broken)[-1]))
    at = titles.index("lightning_hooks: grad_flow/grad_norm")
    assert titles[at + 1] == "lightning_hooks: grad_flow/grad_norm_step"
    first_end = _run(demo, "broken")["grad_flow/global/grad_norm"][0][0]
    texts: dict[str, list[int]] = {ALARM_STEP_TEXT: [], ALARM_TEXT: []}
    for path in {p.parent for p in broken.rglob("events.out.tfevents.*")}:
        acc = EventAccumulator(str(path), size_guidance={"tensors": 0})
        acc.Reload()
        for tag, steps in texts.items():
            steps += [e.step for e in acc.Tensors(f"{tag}/text_summary")]
    # a logging step's text before the first epoch ended, and the epoch's summary at its end
    assert any(step < first_end for step in texts[ALARM_STEP_TEXT]), texts
    assert first_end in texts[ALARM_TEXT]
