"""LitGPT's own ``litgpt pretrain``, switched on without code: ``LIGHTNING_HOOKS=
grad_flow`` makes Fabric's entry point add ``GradFlowCallback``, which logs per-layer gradient
statistics into LitGPT's own TensorBoard logger. A 2-layer, 16-wide config, local random tokens
(``tests/litgpt_data.py``), 50 optimizer steps on one CPU process; LitGPT clips at 1.0.

LitGPT is installed by ``./dev`` into ``.venv/extras/litgpt`` (its pins would move the test
dependencies); the test is skipped where that folder is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import read_scalars

ROOT = Path(__file__).resolve().parents[1]
LITGPT = ROOT / ".venv" / "extras" / "litgpt"
STEPS, BATCH, SEQ = 50, 4, 16

CONFIG = f"""
model_config:
  name: tiny
  block_size: {SEQ}
  vocab_size: 64
  padded_vocab_size: 64
  n_layer: 2
  n_head: 2
  n_embd: 16
  rotary_percentage: 1.0
  parallel_residual: false
  bias: false
  norm_class_name: RMSNorm
  mlp_class_name: LLaMAMLP
  intermediate_size: 32
precision: 32-true
devices: 1
logger_name: tensorboard
data:
  class_path: litgpt_data.RandomTokens
train:
  global_batch_size: {BATCH}
  micro_batch_size: {BATCH}
  max_tokens: {STEPS * BATCH * SEQ}
  max_seq_length: {SEQ}
  log_interval: 1
  save_interval: 100000
  lr_warmup_steps: 2
  max_norm: 1.0
eval:
  interval: 100000
  initial_validation: false
  final_validation: false
"""


@pytest.mark.skipif(not (LITGPT / "litgpt").is_dir(), reason="./dev installs LitGPT")
def test_litgpt_pretrain_logs_per_layer_gradients_when_switched_on(tmp_path: Path) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(CONFIG + f"out_dir: {tmp_path / 'out'}\n")
    paths = [str(ROOT / "tests"), str(LITGPT), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "LIGHTNING_HOOKS": "grad_flow", "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run(
        [sys.executable, "-m", "litgpt", "pretrain", "tiny", "--config", str(config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "GradFlowCallback" in out  # Fabric's loader names what the entry point added
    scalars = read_scalars(tmp_path / "out" / "logs")
    layers = {t.rsplit("/", 1)[1] for t in scalars if t.startswith("grad_flow/grad_norm_step/")}
    blocks = [f"transformer.h.{i}.{m}" for i in (0, 1) for m in ("attn.qkv", "attn.proj")]
    assert {"lm_head", "transformer.wte", *blocks} <= layers, sorted(layers)
    # the default cadence of 50 under Fabric: the first logging step is 49
    applied = dict(scalars["grad_flow/global/grad_norm_step"])
    preclip = dict(scalars["grad_flow/global/grad_norm_preclip_step"])
    assert sorted(applied) == [STEPS - 1]
    # LitGPT clips at max_norm 1.0: the applied norm is the clip's, the pre-clip one above it
    assert applied[STEPS - 1] == pytest.approx(min(1.0, preclip[STEPS - 1]), rel=1e-4)
