"""Shared test fixtures: tiny models, a CPU trainer factory and a TensorBoard event reader."""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import Logger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks.callbacks.trainer import TrainerView
from lightning_hooks.tags import ALARM_STEP_TEXT

os.environ.setdefault("PL_DISABLE_FORK", "1")
if "LH_TORCH_THREADS" in os.environ:  # other floating-point bits, as another CPU gives them
    torch.set_num_threads(int(os.environ["LH_TORCH_THREADS"]))
# Every guard raises in the suite: a bug in a hook fails its test (test_guard.py turns it off).
os.environ["LIGHTNING_HOOKS_STRICT"] = "1"


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test starts from torch's seed 0 (torch seeds itself at random in each process):
    a model's initial weights, and so whether its loss bounces enough for *diverging* to warn,
    do not depend on the process or on the tests run before."""
    torch.manual_seed(0)


def dataset(n: int = 32, features: int = 8, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class TinyMLP(pl.LightningModule):
    """8 -> 16 -> 16 -> 1 with ReLUs; 4 batches of 8 per epoch."""

    def __init__(self, inplace: bool = False, lr: float = 0.1, fail_at_step: int = -1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 16),
            nn.ReLU(inplace=inplace),
            nn.Linear(16, 16),
            nn.ReLU(inplace=inplace),
            nn.Linear(16, 1),
        )
        self.lr = lr
        self.fail_at_step = fail_at_step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.fail_at_step:
            raise RuntimeError("boom in training_step")
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(dataset(), batch_size=8)


class TwoOptimizers(TinyMLP):
    """Manual optimization: each batch steps two optimizers, the first Linear pair's then the
    last Linear's, so the first steps on even optimizer steps and the second on odd ones.
    Records each batch's gradient norms, in plain torch. With ``spare``, the second also holds
    ``spare``, a layer the forward never uses: it never gets a gradient."""

    def __init__(self, spare: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.norms: dict[int, dict[str, float]] = {}
        self.spare = nn.Linear(4, 4) if spare else None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        first, second = self.optimizers()  # type: ignore[misc]
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.manual_backward(loss)
        self.norms[self.trainer.global_step] = {
            name: float(torch.cat([p.grad.flatten() for p in layer.parameters()]).norm())
            for name, layer in (("net.0", self.net[0]), ("net.4", self.net[4]))
        }
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
        return loss.detach()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        first = [*self.net[0].parameters(), *self.net[2].parameters()]
        second = [*self.net[4].parameters()]
        if self.spare is not None:
            second.extend(self.spare.parameters())
        return [torch.optim.SGD(first, lr=0.1), torch.optim.SGD(second, lr=0.1)]


class BoundedMLP(TinyMLP):
    """TinyMLP with its second ReLU a Tanh: every callback has something to watch at its
    defaults (SaturationCallback watches bounded activations only, and idles without one)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net[3] = nn.Tanh()


class TinyCNN(pl.LightningModule):
    """conv + BatchNorm + ReLU twice, then a linear head; 8x8 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(24, 3, 8, 8, generator=g)
        y = torch.randint(0, 4, (24,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=8)


def default_callback_types() -> list[type[pl.Callback]]:
    """Every callback class the package exports that can be built with no argument.

    ``StatsCallback`` needs its statistics, so it is left out.
    """
    import lightning_hooks

    exported = [getattr(lightning_hooks, name) for name in lightning_hooks.__all__]
    return [
        obj
        for obj in exported
        if isinstance(obj, type) and issubclass(obj, pl.Callback) and _needs_no_argument(obj)
    ]


def _needs_no_argument(cls: type) -> bool:
    optional = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return all(
        p.default is not p.empty or p.kind in optional
        for p in inspect.signature(cls).parameters.values()
    )


def make_trainer(root: Path, **kwargs: Any) -> pl.Trainer:
    """A quiet CPU trainer logging to TensorBoard under ``root/tb/version_0``."""
    options: dict[str, Any] = {
        "max_epochs": 1,
        "accelerator": "cpu",
        "devices": 1,
        "logger": TensorBoardLogger(str(root), name="tb", version=0),
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "log_every_n_steps": 1,
        "num_sanity_val_steps": 0,
    }
    options.update(kwargs)
    return pl.Trainer(**options)


@pytest.fixture
def trainer_factory(tmp_path: Path) -> Callable[..., pl.Trainer]:
    return lambda **kwargs: make_trainer(tmp_path, **kwargs)


class MetricsOnlyLogger(Logger):
    """A real Lightning logger that keeps scalars only (like a user's own): ``logged`` holds
    ``(metrics, step)`` per ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[dict[str, float], int | None]] = []

    @property
    def name(self) -> str:
        return "metrics_only"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        del params, args, kwargs

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((dict(metrics), step))


def epoch_end_step(stepped: int) -> int:
    """The step Lightning logs an epoch's metrics at, and the library the epoch's values.

    ``stepped`` batches have stepped since the fit began (``trainer.global_step`` where each makes
    one optimizer step): Lightning logs at its count of them, and its fit loop lowers the count by
    one around the epoch's metrics, the step of the epoch's last batch that stepped.
    """
    return stepped - 1


def read_scalars(logdir: Path | str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under ``logdir``: ``tag -> [(step, value), ...]``."""
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for acc in _accumulators(logdir):
        for tag in acc.Tags()["scalars"]:
            out[tag].extend((e.step, e.value) for e in acc.Scalars(tag))
    return dict(out)


def read_alarm_texts(logdir: Path | str) -> list[str]:
    """Every text the alarms wrote (tags ``grad_flow/alarms...``), from the event files.

    They are in the order written: by step, a logging step's text before the epoch's summary at
    the same step.
    """
    out = []
    for acc in _accumulators(logdir):
        for tag in acc.Tags()["tensors"]:
            if tag.startswith("grad_flow/alarms"):
                epoch = not tag.startswith(ALARM_STEP_TEXT)
                out += [
                    (e.step, epoch, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)
                ]
    return [text for _, _, text in sorted(out)]


def read_image_tags(logdir: Path | str) -> list[str]:
    """Every image tag in the event files under ``logdir``."""
    return sorted(tag for acc in _accumulators(logdir) for tag in acc.Tags()["images"])


def _accumulators(logdir: Path | str) -> list[EventAccumulator]:
    dirs = sorted({p.parent for p in Path(logdir).rglob("events.out.tfevents.*")})
    accs = []
    for d in dirs:
        acc = EventAccumulator(
            str(d), size_guidance={"scalars": 0, "images": 0, "histograms": 0, "tensors": 0}
        )
        acc.Reload()
        accs.append(acc)
    return accs


def hooks_left(model: nn.Module) -> list[str]:
    """Names of every module and parameter hook dict that is not empty."""
    left = []
    for name, module in model.named_modules():
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
        ):
            if getattr(module, attr):
                left.append(f"{name or '<root>'}.{attr}")
    for name, param in model.named_parameters():
        for attr in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            if getattr(param, attr, None):
                left.append(f"{name}.{attr}")
    return left


def trainer_view_members() -> set[str]:
    """Names of every member of ``TrainerView``: its attributes and its properties."""
    properties = {name for name in vars(TrainerView) if not name.startswith("_")}
    return set(TrainerView.__annotations__) | properties


def read_histograms(logdir: Path | str) -> dict[str, list[tuple[int, Any]]]:
    """Every histogram in the event files under ``logdir``: ``tag -> [(step, value), ...]``.

    Each value has ``min``, ``max``, ``num``, ``sum``, ``sum_squares``, ``bucket_limit`` (right
    edges) and ``bucket`` (counts).
    """
    out: dict[str, list[tuple[int, Any]]] = defaultdict(list)
    for acc in _accumulators(logdir):
        for tag in acc.Tags()["histograms"]:
            out[tag].extend((e.step, e.histogram_value) for e in acc.Histograms(tag))
    return dict(out)


_LAUNCHER_ENV = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_script(script: str, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``tests/<script> --out OUT [args]`` (a multi-process launch) in a clean environment.

    Lightning's launcher variables of this process are dropped, so the script starts its own
    processes; the repository root is put on ``PYTHONPATH``. A non-zero exit fails the test.
    """
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(root / "tests" / script), "--out", str(out), *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


collect_ignore = ["litgpt_data.py"]
"""Imported by LitGPT's CLI in ``tests/test_litgpt.py``'s subprocess only (it needs LitGPT on
the path): not a test module, and ``--doctest-modules`` would import it."""


def load_benchmark(name: str) -> Any:
    """``benchmarks/<name>.py`` as a module (registered in ``sys.modules``, where its
    dataclasses look their module up; ``benchmarks/`` on ``sys.path`` for its imports)."""
    if name in sys.modules:
        return sys.modules[name]
    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    if str(folder) not in sys.path:  # as running the script does: its siblings import
        sys.path.append(str(folder))
    path = folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def fit_alarms(trainer: pl.Trainer, model: pl.LightningModule) -> list[warnings.WarningMessage]:
    """``trainer.fit(model)``, and the ``TrainingAlarmWarning``s it raised (every one)."""
    from lightning_hooks.errors import TrainingAlarmWarning

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(model)
    return [w for w in record if issubclass(w.category, TrainingAlarmWarning)]
