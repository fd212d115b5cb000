"""A fault on one rank is agreed by every rank: 2 CPU processes (gloo), DDP and FSDP2.

One launch of ``tests/fault_run.py`` per strategy (about 20 s each on 2 shared cores) serves the
tests here. Lightning's DDP launcher re-runs the script for rank 1, and a hung rank outlives
``subprocess.run``'s timeout (which kills rank 0 only): the launch starts in its own session and
at ``LIMIT_S`` the whole process group is killed and the test fails, so a hang fails the test
instead of stalling the suite.

Every fit trains 8 optimizer steps, logging steps 0, 3, 4 and 7. The disable step of each fault
(on rank 1 only):

| fit | fault | DDP | FSDP2 |
| --- | --- | --- | --- |
| quiet | gradient alarms' update from step 1 on (``on_before_optimizer_step``) | 1 | 1 |
| quiet_no_loss | the same, no loss rule | 3 | 3 |
| logging | the write of logging step 3 (after its collectives) | 4 | 4 |
| loss | the loss rules at step 2 | 2 | 2 |
| epoch_end | the alarms' end of epoch 0 | 4 | 4 |
| output_grad | the output-gradient tensor hook in the backward of step 3 | 3 | - |
| optimizer_hook | the optimizer's step post-hook at step 3 | 3 | - |
| stats_logging | a ``StatsCallback`` statistic's forward hook at step 3 | 3 | 3 |
| stats_write | its host summary of logging step 0 | 3 | - |
| stats_epoch_end | its epoch end's host part, epoch 0 | 4 | 4 |
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fault_run import JUMP, OFFSET

from conftest import _LAUNCHER_ENV

LIMIT_S = 150  # a launch takes about 20 s; a hang ends here

DISABLED = {
    "quiet": 1,  # carried on the same batch's loss all_reduce, read at once on the CPU
    "quiet_no_loss": 3,  # no loss collective: the next logging step's agreement
    "logging": 4,  # the next batch's loss all_reduce
    "loss": 2,  # the loss rules raise after the batch's all_reduce: the next batch's
    "epoch_end": 4,  # the first batch of the next epoch
    "output_grad": 3,  # carried on the same batch's loss all_reduce, after the backward
    "optimizer_hook": 3,  # the same, after the optimizer step
    "stats_logging": 3,  # the logging step of the same step
    "stats_write": 3,  # the next logging step
    "stats_epoch_end": 4,  # the next logging step, the next epoch's first step
}
HOOK = {
    "quiet": "on_before_optimizer_step hook: RuntimeError: injected fault in update",
    "quiet_no_loss": "on_before_optimizer_step hook: RuntimeError: injected fault in update",
    "logging": "on_train_batch_end hook: RuntimeError: injected fault in step_values",
    "loss": "on_train_batch_end hook: RuntimeError: injected fault in update_loss",
    "epoch_end": "on_train_epoch_end hook: RuntimeError: injected fault in end_epoch",
    "output_grad": "output gradient hook: RuntimeError: injected fault in _output_norm",
    "optimizer_hook": "optimizer step post-hook: RuntimeError: injected fault in _after_step",
    "stats_logging": "forward hook on 'net.0': RuntimeError: injected fault in observe",
    "stats_write": "on_train_batch_end hook: RuntimeError: injected fault in summarize",
    "stats_epoch_end": "on_train_epoch_end hook: RuntimeError: injected fault in write_epoch",
}
FSDP_FITS = ("quiet", "quiet_no_loss", "logging", "loss", "epoch_end", "stats_logging")


def launch(strategy: str, out: Path) -> list[dict[str, Any]]:
    """``tests/fault_run.py`` on 2 processes in its own session, killed as a group at
    ``LIMIT_S``; each rank's report."""
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    env.pop("LIGHTNING_HOOKS_STRICT", None)  # the guard must catch the injected faults
    command = [sys.executable, str(root / "tests" / "fault_run.py"), "--out", str(out)]
    proc = subprocess.Popen(
        [*command, "--strategy", strategy],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # rank 0 and the rank it launched
        output, _ = proc.communicate()
        pytest.fail(f"{strategy}: hung past {LIMIT_S} s, killed:\n{output[-3000:]}")
    assert proc.returncode == 0, output[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch("ddp", tmp_path_factory.mktemp("faults_ddp"))


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch("fsdp", tmp_path_factory.mktemp("faults_fsdp"))


def _check_disabled(ranks: list[dict[str, Any]], fit: str) -> None:
    """Both ranks finished the fit, disabled the callback at the expected step, and only rank 0
    warned, once, naming rank 1, the hook and the error."""
    name = "StatsCallback" if fit.startswith("stats") else "GradFlowCallback"
    for report in ranks:
        run = report[fit]
        assert run["global_step"] == 8, (fit, run)
        assert run["disabled_step"] == DISABLED[fit], (fit, run["disabled_step"])
        assert run["failed"] == f"rank 1: {HOOK[fit]}"
        # nothing of ours after the disable step: no collective left waiting for a rank
        assert sum(run["steps"][DISABLED[fit] + 1 :]) == 0, run["steps"]
    assert ranks[1][fit]["warnings"] == []
    want = f"{name} is disabled on every rank from step {DISABLED[fit]} for the rest of the fit"
    assert [w.startswith(f"{want}: rank 1: {HOOK[fit]}.") for w in ranks[0][fit]["warnings"]] == [
        True
    ]


@pytest.mark.parametrize("fit", list(DISABLED))
def test_ddp_fault_on_one_rank_is_agreed(fit: str, ddp: list[dict[str, Any]]) -> None:
    _check_disabled(ddp, fit)


@pytest.mark.parametrize("fit", (*FSDP_FITS, "stats_epoch_end"))
def test_fsdp2_fault_on_one_rank_is_agreed(fit: str, fsdp: list[dict[str, Any]]) -> None:
    _check_disabled(fsdp, fit)


@pytest.mark.parametrize(
    ("strategy", "fit", "stopped"),
    [
        ("ddp", "stop", 3),  # carried on step 2's loss all_reduce: step 2 is the last
        ("ddp", "stop_no_loss", 4),  # the next logging step's agreement: step 3 is the last
        ("fsdp", "stop", 3),
    ],
)
def test_stop_read_on_one_rank_stops_every_rank_at_the_same_step(
    strategy: str, fit: str, stopped: int, request: pytest.FixtureRequest
) -> None:
    ranks = request.getfixturevalue(strategy)
    assert [r[fit]["global_step"] for r in ranks] == [stopped, stopped]
    assert all(r[fit]["disabled_step"] is None for r in ranks)


def test_healthy_fits_make_one_agreement_per_epoch_end_and_none_per_quiet_step(
    ddp: list[dict[str, Any]], fsdp: list[dict[str, Any]]
) -> None:
    # DDP: the loss all_reduce at every batch carries the agreement; a logging step adds its 3
    # (output gradients, statistics, stability); the epoch end 3 + 1 agreement + 2 results.
    assert ddp[0]["healthy"]["steps"] == [4, 1, 1, 4] * 2
    assert ddp[0]["healthy"]["epochs"][0]["ours_by_name"] == {"all_reduce": 7, "all_gather": 6}
    # FSDP2: + the shard norms' all_gather at every step.
    assert fsdp[0]["healthy"]["steps"] == [6, 2, 2, 6] * 2
    # A StatsCallback: its packed all_gather and one small all_reduce per logging step; at the
    # first, the new rows' names (one all_gather_object).
    assert ddp[0]["stats_logging"]["steps"][:1] == [3]


def test_gan_on_two_processes_keeps_the_loss_rules(ddp: list[dict[str, Any]]) -> None:
    # Lightning's GAN recipe returns its loss on every rank: the rules read the mean loss over
    # ranks and fire on both, at the same step, with the same value.
    ranks = [r["gan"] for r in ddp]
    losses = [{int(s): v for s, v in r["losses"].items()} for r in ranks]
    jump = 2 * JUMP  # two optimizer steps per batch
    assert losses[1][jump] > OFFSET > losses[0][jump]
    for report in ranks:
        assert report["loss_reading"] == "mean" and report["global_step"] == 16
    assert ranks[0]["alarms"] == ranks[1]["alarms"]
    diverging = [a for a in ranks[0]["alarms"]["0"] if a[0] == "diverging"]
    assert diverging and diverging[0][1] == jump
    assert diverging[0][2] == pytest.approx((losses[0][jump] + losses[1][jump]) / 2, rel=1e-5)
    # one warning per epoch (the loss stays up): at the jump, then again in the second epoch
    speaker = "GradFlowCallback [diverging]: "
    assert all(w.startswith(speaker) for w in ranks[0]["warnings"])
    found = [w.removeprefix(speaker).split(":")[0] for w in ranks[0]["warnings"]]
    assert found[0] == f"loss diverging at optimizer step {jump}", found
    assert all(w.startswith("loss diverging at optimizer step ") for w in found) and len(found) == 2


def test_manual_optimization_where_ranks_disagree_turns_the_loss_rules_off_on_all(
    ddp: list[dict[str, Any]],
) -> None:
    # Rank 1's training_step returns nothing: decided at step 0 by both ranks together.
    ranks = [r["manual_skip"] for r in ddp]
    for report in ranks:
        assert report["loss_reading"] == "off" and report["global_step"] == 8
    assert [w.split(": ")[1] for w in ranks[0]["warnings"]] == [
        "the loss rules (diverging, loss_spike) are off from step 0 on"
    ]
    assert ranks[1]["warnings"] == []
    # the loss all_reduce at step 0 only (it carries the agreement there too), then one
    # agreement per logging step
    assert ranks[0]["steps"] == [1 + 3, 0, 0, 1 + 3, 1 + 3, 0, 0, 1 + 3]


def test_the_loss_moves_to_the_nccl_group_device_without_a_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No GPU here: an NCCL group is faked, and every Tensor.to is recorded (a CUDA target is
    # answered with a CPU copy), so what is shown is the path a CPU loss takes under NCCL: moved
    # to the group's device, non_blocking, as float32; under gloo it stays on the CPU.
    import torch
    import torch.distributed as dist
    from torch.overrides import TorchFunctionMode

    from lightning_hooks.callbacks.loss_agreement import _all_reduce_loss_and_flags
    from lightning_hooks.core import distributed

    assert distributed.group_device() == torch.device("cpu")  # no group, as gloo's
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    reduced: list[str] = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, **k: reduced.append(str(t.device)))
    assert distributed.group_device() == torch.device("cuda", 3)
    moves: list[tuple[str, bool]] = []

    class RecordMoves(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            if func is torch.Tensor.to and str(kwargs.get("device", "")).startswith("cuda"):
                moves.append((str(kwargs["device"]), bool(kwargs.get("non_blocking"))))
                kwargs = {**kwargs, "device": "cpu"}
            return func(*args, **kwargs)

    loss = torch.tensor(2.5, dtype=torch.bfloat16)  # on the CPU: NCCL would refuse it
    with RecordMoves():
        carried = _all_reduce_loss_and_flags(loss, failed=True, stop=False)
    # the flags, then the loss: each to cuda:3 without blocking
    assert moves == [("cuda:3", True), ("cuda:3", True)]
    assert carried.tolist() == [2.5, 1.0, 1.0, 0.0] and carried.dtype == torch.float32
    assert len(reduced) == 1  # the one all_reduce of the batch


def test_the_carried_loss_keeps_no_graph_alive() -> None:
    """Under manual optimization the loss the ranks agree on still has its graph: the copy
    that carries it is out of autograd, so the batch's graph is freed with the batch."""
    import torch

    from lightning_hooks.callbacks.loss_agreement import _all_reduce_loss_and_flags

    weight = torch.ones(3, requires_grad=True)
    loss = (weight * 2.0).sum()
    carried = _all_reduce_loss_and_flags(loss, failed=False, stop=False)
    assert carried.grad_fn is None and not carried.requires_grad
    assert carried.tolist() == [6.0, 1.0, 0.0, 0.0]
