"""The README and the docs pages: every table renders, every Python block runs, the site builds.

Tables are checked on markdown-it-py's own parse (the CommonMark + GFM-tables parser the
rendered pages agree with): a line that starts with ``|`` outside a rendered table is a stray
row, and every row of a table has the header's number of cells.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IDS = [str(p.relative_to(ROOT)) for p in PAGES]
MarkdownIt = pytest.importorskip("markdown_it").MarkdownIt


def _tokens(text: str) -> list[Any]:
    return list(MarkdownIt("commonmark").enable("table").parse(text))


def _row(line: str) -> list[str]:
    """The GFM cells of a table row: split on pipes not escaped with a backslash."""
    inner = line.strip().removeprefix("|").removesuffix("|")
    return re.split(r"(?<!\\)\|", inner)


def _cells(line: str) -> int:
    """How many GFM cells a table row has."""
    return len(_row(line))


def table_problems(text: str) -> list[str]:
    """Stray table rows and rows whose cell count differs from their header's."""
    lines = text.splitlines()
    covered: set[int] = set()
    problems = []
    for token in _tokens(text):
        if token.type in ("fence", "code_block", "html_block") and token.map:
            covered.update(range(*token.map))
        if token.type == "table_open" and token.map:
            start, end = token.map
            covered.update(range(start, end))
            width = _cells(lines[start])
            problems += [
                f"line {i + 1}: {_cells(lines[i])} cells, the header has {width}"
                for i in range(start, end)
                if _cells(lines[i]) != width
            ]
    problems += [
        f"line {i + 1}: a table row outside any table: {line[:60]!r}"
        for i, line in enumerate(lines)
        if line.lstrip().startswith("|") and i not in covered
    ]
    return problems


def test_the_table_check_catches_both_faults() -> None:
    cut = "| a | b |\n| --- | --- |\n| 1 | 2 |\n\n| 3 | 4 |\n"
    assert table_problems(cut) == ["line 5: a table row outside any table: '| 3 | 4 |'"]
    wide = "| a | b |\n|---|---|---|\n| 1 | 2 | 3 |\n"
    assert len(table_problems(wide)) == 3  # not a table at all: every row is stray
    ragged = "| a | b |\n| --- | --- |\n| 1 | 2 | 3 |\n| `x \\| y` | 2 |\n"
    assert table_problems(ragged) == ["line 3: 3 cells, the header has 2"]


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_table_renders(page: Path) -> None:
    assert table_problems(page.read_text()) == []


def test_the_readme_is_a_five_minute_read() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 250
    text = "\n".join(lines)
    assert "./dev demo" in text and "./dev test" in text
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name != "index.md":
            assert f"docs/{page.name}" in text, f"the README does not link {page.name}"
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"the README links {target}, which does not exist"


class DocNet(pl.LightningModule):
    """The ``model`` the documentation's snippets train: a stem, a ``layer4`` and an ``fc``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU())
        self.layer4 = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(4 * 8 * 8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer4(self.stem(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        return _loader()


def _loader() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 1, 8, 8, generator=generator)
    return DataLoader(TensorDataset(x, (x.mean((1, 2, 3)) > 0).long()), batch_size=8)


def _python_blocks() -> list[tuple[str, str]]:
    blocks = []
    for page, name in zip(PAGES, IDS, strict=True):
        fences = [t for t in _tokens(page.read_text()) if t.type == "fence"]
        for token in fences:
            if token.info.strip() == "python" and token.map:
                blocks.append((f"{name}:{token.map[0] + 1}", token.content))
    return blocks


BLOCKS = _python_blocks()


@pytest.mark.parametrize("code", [c for _, c in BLOCKS], ids=[n for n, _ in BLOCKS])
def test_every_python_block_runs(
    code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the snippets' Trainers log under ./lightning_logs, ./runs
    pl.seed_everything(0, verbose=False)
    model = DocNet()
    namespace: dict[str, Any] = {
        "__name__": "__doc_snippet__",
        "model": model,
        "train_loader": _loader(),
        "loader": _loader(),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.05),
        "loss_fn": nn.functional.cross_entropy,
        "my_hook": lambda module, inputs, output: None,
        "bank": [],
        "nn": nn,
        "pl": pl,
    }
    code = code.replace("max_epochs=10", "max_epochs=2")  # the same code, a shorter fit
    exec(compile(code, "<doc snippet>", "exec"), namespace)


def test_the_docs_site_builds_in_strict_mode(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")  # the dev extra; `./dev test` builds the site too
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "cli" / "index.html").is_file()


COST_ROWS = {  # the README's row label -> the configuration in every_stat.json
    "all callbacks, defaults": "all, defaults",
    "floor: one gradient read": "floor: one gradient read (_foreach_norm)",
    "every statistic, every step, every module": "all, every stat/step/leaf",
    "the same, `ActivationStatsCallback(fused=True)`": "all, every stat/step/leaf, fused",
    "tutorial approach (`.item()` hooks, far fewer statistics)": "tutorial (.item() hooks)",
}


def _cost_table() -> dict[str, list[str]]:
    """The rows of the table in the README's "What it costs", label -> cells, bold stripped."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## What it costs") : text.index("## Where it runs")]
    assert table_problems(section) == []
    cells = _tables(section)[0]
    assert cells[0] == ["configuration", "MLP", "CNN", "transformer"], cells[0]
    assert "`benchmarks/results/every_stat.md`" in section
    assert "benchmarks/overhead.py" in section and "--out benchmarks/results/every_stat" in section
    return {row[0]: row[1:] for row in cells[2:]}


def _tables(section: str) -> list[list[list[str]]]:
    """Each Markdown table of ``section``: its rows' cells, bold stripped."""
    tables: list[list[list[str]]] = []
    previous = False
    for line in section.splitlines():
        row = line.startswith("| ")
        if row and not previous:
            tables.append([])
        if row:
            tables[-1].append([c.strip().strip("*") for c in _row(line)])
        previous = row
    return tables


def test_the_readme_launch_bound_figures_are_the_saved_paired_run() -> None:
    """README "What it costs", the launch-bound table: benchmarks/results/paired_launch.json
    (``benchmarks/paired.py``), process CPU time against bare in the same ring: mean step and
    median (quiet) step, the median over the rounds and their range."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## What it costs") : text.index("## Where it runs")]
    cells = _tables(section)[1]
    assert cells[0] == ["configuration", "mean step", "quiet step"]
    rows = json.loads((ROOT / "benchmarks/results/paired_launch.json").read_text())["rows"]
    labels = {
        "`GradFlowCallback()`": "GradFlowCallback",
        "all five at their defaults": "all, defaults",
        "floor: one `torch._foreach_norm`": "floor: one gradient read (_foreach_norm)",
        "six callbacks that do nothing": "6 empty callbacks",
        "tutorial (`.item()` hooks)": "tutorial (.item() hooks)",
    }

    def cell(ratio: dict[str, float]) -> str:
        return f"{ratio['median']:.3f}x ({ratio['min']:.3f}-{ratio['max']:.3f})"

    expected = {
        label: [cell(rows[config]["mean"]), cell(rows[config]["quiet"])]
        for label, config in labels.items()
    }
    assert {row[0]: row[1:] for row in cells[2:]} == expected
    assert f"a bare step of {rows['bare']['step_ms']:.1f} ms" in " ".join(section.split())
    assert "--out benchmarks/results/paired_launch" in section


def test_the_readme_before_and_after_figures_are_the_saved_comparison() -> None:
    """README "What it costs": this package against the one before its modules were merged, in
    the same rings, benchmarks/results/paired_vs_before.json, mean step against bare."""
    text = " ".join((ROOT / "README.md").read_text().split())
    rows = json.loads((ROOT / "benchmarks/results/paired_vs_before.json").read_text())["rows"]

    def mean(config: str) -> str:
        return f"{rows[config]['mean']['median']:.3f}x"

    for label, config in (
        ("all five", "all, defaults"),
        ("`GradFlowCallback()`", "GradFlowCallback"),
    ):
        assert f"{label} {mean(config)} against {mean(config + ' @ base')}" in text
    floor = "floor: one gradient read (_foreach_norm)"
    assert f"read {mean(floor)} and {mean(floor + ' @ base')}" in text


def test_the_readme_cost_figures_are_the_saved_benchmark_run() -> None:
    # README "What it costs" is benchmarks/results/every_stat.json (CPU-time median ratios, bare
    # step times): re-running the benchmark with --save and not updating the README fails.
    timing = json.loads((ROOT / "benchmarks/results/every_stat.json").read_text())["timing"]
    models = ("mlp", "cnn", "transformer")
    expected = {
        label: [f"{timing[m][config]['cpu']['ratio_median']:.3f}x" for m in models]
        for label, config in COST_ROWS.items()
    }
    expected["bare step"] = [f"{timing[m]['bare']['cpu']['step_ms']:.1f} ms" for m in models]
    assert _cost_table() == expected
    defaults = [timing[m]["all, defaults"]["cpu"]["ratio_median"] for m in models]
    first_screen = " ".join((ROOT / "README.md").read_text().split())
    assert f"{min(defaults):.2f}x to {max(defaults):.2f}x a bare step at the defaults" in (
        first_screen
    )


GPU_MODELS = {  # the README's column -> (saved run, model)
    "launch": ("gpu_h100_small_grouped", "launch"),
    "MLP": ("gpu_h100_small_grouped", "mlp"),
    "CNN": ("gpu_h100_small_grouped", "cnn"),
    "transformer": ("gpu_h100_small_grouped", "transformer"),
    "ResNet-50": ("gpu_h100_large_grouped", "resnet50"),
    "GPT-2": ("gpu_h100_large_grouped", "gpt2"),
}
GPU_RUNS = {
    "gpu_h100_small_grouped": ("H100", "32-true"),
    "gpu_h100_large_grouped": ("H100", "bf16-mixed"),
}


def test_the_readme_gpu_figures_are_the_saved_gpu_runs() -> None:
    """README "What it costs", the GPU table: benchmarks/results/gpu_h100_small_grouped.json
    (the small models) and gpu_h100_large_grouped.json (ResNet-50, GPT-2), CPU-time ratios of the
    mean step / the median (quiet) step, by benchmarks/gpu_session.sh; "not run" where a
    configuration was not timed on that model."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## What it costs") : text.index("## Where it runs")]
    cells = _tables(section)[2]
    assert cells[0] == ["configuration", *GPU_MODELS]
    runs = {
        name: json.loads((ROOT / f"benchmarks/results/{name}.json").read_text())
        for name in GPU_RUNS
    }
    for name, (device, precision) in GPU_RUNS.items():
        assert device in runs[name]["env"]["device"]
        assert runs[name]["env"]["precision"] == precision
    labels = {
        "`GradFlowCallback()`": "GradFlowCallback",
        "all five": "all, defaults",
        "floor": "floor: one gradient read (_foreach_norm)",
    }

    def cell(name: str, model: str, config: str) -> str:
        row = runs[name]["timing"][model].get(config)
        if row is None:
            return "not run"
        return f"{row['cpu']['ratio_median']:.3f} / {row['cpu_median']['ratio_median']:.3f}x"

    expected = {
        label: [cell(name, model, config) for name, model in GPU_MODELS.values()]
        for label, config in labels.items()
    }
    expected["bare step"] = [
        f"{runs[name]['timing'][model]['bare']['cpu']['step_ms']:.1f} ms"
        for name, model in GPU_MODELS.values()
    ]
    assert {row[0]: row[1:] for row in cells[2:]} == expected
    assert "measured 2026-11-26" in " ".join(section.split())
