"""A real ``tensorboard`` serves a real run: what its HTTP data API returns is what we meant."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl

import lightning_hooks
from lightning_hooks import GradFlowCallback
from lightning_hooks.logging import log_scalars

from conftest import TinyMLP, make_trainer, read_scalars
from tensorboard_server import TensorBoard, read_layouts, tensorboard

RUN = "tb/version_0"
# A family of its own: grad_flow/alarms/{rule} is logged from the first epoch on (default alarms).
ALARM = "watchdog/alarms/late_rule"
LAYERS = ("net.0", "net.2", "net.4")


class LateAlarm(pl.Callback):
    """Logs an alarm tag in the second epoch only: a chart the first layout did not have."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:
            log_scalars(trainer.loggers, {ALARM: 1.0}, trainer.global_step)


def _poll(server: TensorBoard, path: str, ready: str, timeout: float = 20.0) -> dict[str, object]:
    """GET ``path`` until ``ready`` shows up in the body (the server loads runs in background)."""
    deadline = time.monotonic() + timeout
    body = server.get(path)
    while ready not in str(body) and time.monotonic() < deadline:
        time.sleep(0.5)
        body = server.get(path)
    return body  # type: ignore[no-any-return]


def test_tensorboard_serves_our_run_as_intended(tmp_path: Path) -> None:
    logdir = tmp_path / "logs"
    callbacks: list[pl.Callback] = [LateAlarm(), GradFlowCallback(histograms=True, heatmap=True)]
    for name in ("ActivationStatsCallback", "DeadReLUCallback"):
        if hasattr(lightning_hooks, name):
            callbacks.append(getattr(lightning_hooks, name)())
    make_trainer(logdir, max_epochs=2, callbacks=callbacks).fit(TinyMLP())
    written = read_scalars(logdir)
    started = time.monotonic()
    with tensorboard(logdir) as server:
        scalar_tags = _poll(server, "/data/plugin/scalars/tags", "grad_flow/global/grad_norm")
        assert server.get("/data/runs") == [RUN]
        plugins = server.get("/data/plugins_listing")
        for plugin in ("scalars", "custom_scalars", "images"):
            assert plugins[plugin]["enabled"], f"{plugin} plugin not active for our run"

        served = set(scalar_tags[RUN])  # type: ignore[call-overload]
        assert {t for t in written if t.count("/") >= 2} <= served

        layout = server.get("/data/plugin/custom_scalars/layout")
        charts = {
            (category["title"], chart["title"]): chart["multiline"]["tag"]
            for category in layout["category"]
            for chart in category["chart"]
        }
        assert ("lightning_hooks: grad_flow", "grad_norm") in charts
        # One layout for every callback's family (written once, by the last of ours) ...
        # Alarms of every family in one category, right after gradient flow, then the notices:
        # in this order.
        families = {t.split("/")[0] for t in written if t.count("/") >= 2 and "/alarms/" not in t}
        titles = [category["title"] for category in layout["category"]]
        assert titles[:3] == [f"lightning_hooks: {c}" for c in ("grad_flow", "alarms", "notices")]
        assert set(titles) == {f"lightning_hooks: {f}" for f in families | {"alarms", "notices"}}
        # ... written at the first logging step, rewritten at the first epoch end (its epoch
        # charts) and when the alarm family appeared in epoch 2: TensorBoard serves the last one.
        assert len(read_layouts(logdir)) == 3
        assert charts[("lightning_hooks: alarms", "watchdog")] == ["^watchdog/alarms/.*"]
        for kind in ("alarms", "notices"):
            assert charts[(f"lightning_hooks: {kind}", "grad_flow")] == [f"^grad_flow/{kind}/.*"]
        assert ("lightning_hooks: alarms", "watchdog") not in {
            (c.title, chart.title) for c in read_layouts(logdir)[1].category for chart in c.chart
        }
        for (_, stat), (per_layer, *_) in charts.items():
            assert any(re.match(per_layer, tag) for tag in served), f"{stat}: matches no tag"

        per_layer, overall = charts[("lightning_hooks: grad_flow", "grad_norm")]
        data = server.get("/data/plugin/custom_scalars/scalars", run=RUN, tag=per_layer)
        assert data["regex_valid"]
        assert set(data["tag_to_events"]) == {f"grad_flow/grad_norm/{layer}" for layer in LAYERS}
        data_global = server.get("/data/plugin/custom_scalars/scalars", run=RUN, tag=overall)
        assert set(data_global["tag_to_events"]) == {"grad_flow/global/grad_norm"}
        for tag, events in data["tag_to_events"].items():
            assert [e[1] for e in events] == [s for s, _ in written[tag]]  # steps: 2 epochs
            assert [e[2] for e in events] == pytest.approx([v for _, v in written[tag]], rel=1e-6)

        images = server.get("/data/plugin/images/tags")
        assert {"grad_flow/chart", "grad_flow/heatmap"} <= set(images[RUN])
        entries = server.get("/data/plugin/images/images", run=RUN, tag="grad_flow/chart")
        assert [e["step"] for e in entries] == [s for s, _ in written["grad_flow/global/grad_norm"]]
        png = server.get_bytes(f"/data/plugin/images/individualImage?{entries[-1]['query']}")
        assert png.startswith(b"\x89PNG") and len(png) > 5000

        histograms = server.get("/data/plugin/histograms/tags")
        assert {f"grad_flow/grad_log10_abs/{layer}" for layer in LAYERS} <= set(histograms[RUN])
        tag = "grad_flow/grad_log10_abs/net.0"
        series = server.get("/data/plugin/histograms/histograms", run=RUN, tag=tag)
        assert [s[1] for s in series] == [s for s, _ in written["grad_flow/global/grad_norm"]]
        for _, _, buckets in series:  # [left, right, count] triples summing to every entry
            assert sum(b[2] for b in buckets) == pytest.approx(4 * (8 * 16 + 16), rel=1e-6)
        if hasattr(lightning_hooks, "ActivationStatsCallback"):
            assert histograms.get(RUN), "the activation callback's histograms are not served"
    assert time.monotonic() - started < 60
