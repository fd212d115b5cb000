"""The README and the docs pages: every table renders, every Python block runs, the site builds
with every parameter of the public classes rendered, the pages speak of the product, and the
README's cost figures are the saved benchmark runs.

Tables are checked on markdown-it-py's own parse (the CommonMark + GFM-tables parser the
rendered pages agree with): a line that starts with ``|`` outside a rendered table is a stray
row, and every row of a table has the header's number of cells.
"""

from __future__ import annotations

import inspect
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

import lightning_hooks

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
    assert len(lines) <= 180
    text = "\n".join(lines)
    assert "./dev demo" in text and "./dev test" in text
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"the README links {target}, which does not exist"


def test_every_page_is_in_the_site_and_speaks_of_the_product() -> None:
    """Every page is in the navigation, and no page or the README names a round of work, an
    issue or a commit as a point of reference: comparisons name releases."""
    nav = (ROOT / "mkdocs.yml").read_text()
    history = re.compile(r"session [0-9]|issue [0-9]|\b(?=[0-9]*[a-f])[0-9a-f]{7,40}\b", re.I)
    for page in PAGES:
        if page.parent.name == "docs":
            assert f" {page.name}" in nav, f"{page.name} is not in mkdocs.yml's nav"
        found = history.findall(page.read_text())
        assert not found, f"{page.name} speaks of history: {found}"


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
WHOLE = "docs/getting-started.md"
"""The page whose snippets define all they use: a reader pastes them in order."""
SNIPPETS = [(name, code) for name, code in BLOCKS if not name.startswith(WHOLE)]


@pytest.mark.parametrize("code", [c for _, c in SNIPPETS], ids=[n for n, _ in SNIPPETS])
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


def test_getting_started_runs_as_written_and_starts_with_the_quickstart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Getting started's snippets run in order in one fresh namespace, as a reader pasting them
    into a script would: nothing is defined beforehand. The first is ``examples/quickstart.py``."""
    blocks = [code for name, code in BLOCKS if name.startswith(WHOLE)]
    assert blocks[0] == (ROOT / "examples" / "quickstart.py").read_text()
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for code in blocks:
        exec(compile(code.replace("max_epochs=3", "max_epochs=1"), WHOLE, "exec"), namespace)
    assert namespace["trainer"].callbacks  # the last snippet's Trainer ran its four callbacks
    assert list((tmp_path / "runs" / "quickstart").glob("version_0/events.out.tfevents.*"))


def test_the_readme_and_getting_started_point_to_the_quickstart() -> None:
    for page in (ROOT / "README.md", ROOT / WHOLE):
        assert "examples/quickstart.py" in page.read_text(), page.name


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
    for name, page in REFERENCE.items():  # every parameter, rendered from the docstrings
        html = (tmp_path / page / "index.html").read_text()
        rendered = set(re.findall(r"<code>([a-z_0-9]+)</code>\s*</td>", html))
        params = set(inspect.signature(getattr(lightning_hooks, name)).parameters)
        assert params <= rendered, f"{page} does not render {sorted(params - rendered)}"


REFERENCE = {  # public class -> its reference page
    "GradFlowCallback": "grad-flow",
    "ActivationStatsCallback": "activation-stats",
    "DeadReLUCallback": "dead-relu",
    "SaturationCallback": "saturation",
    "LayerTimeCallback": "layer-time",
    "FeatureMapCallback": "feature-map",
    "StatsCallback": "stats-callback",
    "AlarmRules": "alarm-rules",
}


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_each_reference_page_read_as_markdown_points_to_help(name: str) -> None:
    """A reference page read as markdown (on GitHub, in an editor) shows the directive, not the
    parameters: the line before it points to the site and to ``help()`` of the same class, whose
    docstring holds every parameter under ``Args:``."""
    text = (ROOT / "docs" / f"{REFERENCE[name]}.md").read_text()
    before = text[: text.index(f"::: lightning_hooks.{name}")]
    assert f"help(lightning_hooks.{name})" in before.split("## Parameters")[-1]
    assert "mkdocs serve" in before.split("## Parameters")[-1]
    doc = inspect.getdoc(getattr(lightning_hooks, name)) or ""
    args = doc[doc.index("Args:") :]
    for param in inspect.signature(getattr(lightning_hooks, name)).parameters:
        assert re.search(rf"^\s+{param}\b", args, re.M), f"help({name}) lacks {param}"


COST_ROWS = {  # (model, device) in the README's table -> (saved result, its model key)
    ("MLP", "CPU"): ("every_stat", "mlp"),
    ("CNN", "CPU"): ("every_stat", "cnn"),
    ("transformer", "CPU"): ("every_stat", "transformer"),
    ("[launch-bound stand-in](docs/glossary.md#launch-bound-stand-in)", "CPU"): (
        "paired_launch",
        "launch",
    ),
    ("launch-bound stand-in", "H100, fp32"): ("gpu_h100_small_grouped", "launch"),
    ("MLP", "H100, fp32"): ("gpu_h100_small_grouped", "mlp"),
    ("CNN", "H100, fp32"): ("gpu_h100_small_grouped", "cnn"),
    ("transformer", "H100, fp32"): ("gpu_h100_small_grouped", "transformer"),
    ("ResNet-50", "H100, bf16-mixed"): ("gpu_h100_large_grouped", "resnet50"),
    ("GPT-2 124M", "H100, bf16-mixed"): ("gpu_h100_large_grouped", "gpt2"),
}
CONFIG = "all, defaults"  # every callback that builds with no argument, at its defaults


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


def _saved(name: str, model: str) -> tuple[float, float]:
    """The bare step (ms) and the mean-step ratio of every callback at its defaults."""
    saved = json.loads((ROOT / f"benchmarks/results/{name}.json").read_text())
    if "rows" in saved:  # benchmarks/paired.py: the paired fits of one model
        rows = saved["rows"]
        return rows["bare"]["step_ms"], rows[CONFIG]["mean"]["median"]
    timing = saved["timing"][model]
    return timing["bare"]["cpu"]["step_ms"], timing[CONFIG]["cpu"]["ratio_median"]


def test_the_readme_cost_table_is_the_saved_benchmark_runs() -> None:
    """README "What it costs": each row is a saved benchmark result, process CPU time against
    bare; re-running a benchmark with --save and not updating the README fails."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## What it costs") : text.index("## Where it runs")]
    assert len(section.strip().splitlines()[1:]) <= 20  # the heading aside
    assert table_problems(section) == []
    (cells,) = _tables(section)
    assert cells[0] == ["model", "device", "bare step", "all six at their defaults"]
    expected = {}
    for (model, device), (name, key) in COST_ROWS.items():
        step_ms, ratio = _saved(name, key)
        expected[(model, device)] = [f"{step_ms:.1f} ms", f"{ratio:.3f}x"]
    assert {(row[0], row[1]): row[2:] for row in cells[2:]} == expected
    for name in {name for name, _ in COST_ROWS.values()} - {"every_stat", "paired_launch"}:
        saved = json.loads((ROOT / f"benchmarks/results/{name}.json").read_text())
        assert "H100" in saved["env"]["device"], name
    assert "docs/overhead.md" in section


def test_the_readme_first_screen_quotes_the_cost_table() -> None:
    cpu = [_saved("every_stat", m)[1] for m in ("mlp", "cnn", "transformer")]
    large = [_saved("gpu_h100_large_grouped", m)[1] for m in ("resnet50", "gpt2")]
    small = [_saved("gpu_h100_small_grouped", m)[1] for m in ("mlp", "cnn", "transformer")]
    text = " ".join((ROOT / "README.md").read_text().split())
    assert f"{min(cpu):.2f}x to {max(cpu):.2f}x a bare step at the defaults on CPU" in text
    assert f"{min(large):.2f}x to {max(large):.2f}x on ResNet-50 and GPT-2 on an H100" in text
    assert f"up to {max(small):.2f}x on small GPU models" in text


def test_the_supported_versions_are_pyprojects() -> None:
    """README "Install and get started" and docs/install.md: the minimum versions it declares."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    minimum = {
        re.split(r"[<>=\[]", spec, maxsplit=1)[0]: spec.split(">=")[1].split(",")[0]
        for spec in project["dependencies"]
        if ">=" in spec
    }
    python = project["requires-python"].removeprefix(">=")
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (
        f"Python {python} or newer, torch {minimum['torch']} or newer, "
        f"Lightning {minimum['pytorch-lightning']} or newer" in readme
    )
    install = (ROOT / "docs" / "install.md").read_text()
    assert f"| Python | {python} or newer |" in install
    assert f"| torch | {minimum['torch']} or newer |" in install
    assert f"`pytorch-lightning` {minimum['pytorch-lightning']} or newer" in install
    assert f"| TensorBoard | {minimum['tensorboard']} or newer |" in install
    for extra in project["optional-dependencies"]:
        assert f"| `{extra}` |" in install, f"docs/install.md does not name the extra {extra!r}"


def test_the_oldest_pair_tested_is_the_floor_declared_and_checked_at_import() -> None:
    """The range we claim is the range we test: ``./dev``'s oldest pair is pyproject's minimum
    torch and Lightning, the one the library checks at import, and the README names both pairs."""
    from lightning_hooks import internals

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    minimum = dict(spec.split(">=") for spec in project["dependencies"] if ">=" in spec)
    dev = (ROOT / "dev").read_text()
    pairs = {
        name: dict(re.findall(r"([a-z-]+)==([\d.]+)", spec))
        for name, spec in re.findall(r'^(OLDEST|NEWEST)_PAIR="([^"]+)"', dev, re.MULTILINE)
    }
    oldest = pairs["OLDEST"]
    assert oldest["torch"].rsplit(".", 1)[0] == minimum["torch"]
    assert oldest["pytorch-lightning"].rsplit(".", 1)[0] == minimum["pytorch-lightning"]
    assert oldest["lightning"] == oldest["pytorch-lightning"]
    floor = ".".join(str(part) for part in internals.OLDEST_TORCH)
    assert floor == minimum["torch"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    for name, pair in pairs.items():
        named = f"torch {pair['torch']}, Lightning {pair['pytorch-lightning']}"
        assert named in readme, (name, named)
