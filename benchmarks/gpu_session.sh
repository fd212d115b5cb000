#!/usr/bin/env bash
# The GPU checks, as one prepared run of at most 10 minutes (about 7.5 on an H100):
#   the CUDA tests (and the Triton read's), the quiet step's host time in our hooks against the
#   floor's (quiet_step.py), what a CUDA graph, the pointer-table kernels or the grouped read
#   save on the norm pass (graph_probe.py), the overhead table on the launch-bound stand-in and the small models
#   (fp32), and on ResNet-50 and GPT-2 124M (bf16-mixed). A logging step against a quiet one:
#   benchmarks/logging_step_gpu.py, separately.
# Run from the repository root on the GPU machine, whose python3 holds torch, Lightning, Triton,
# torchvision and transformers; results go to $OUT (default ./gpu_out): log.txt and the tables' .md and .json. Each part has a time
# limit (seconds, overridable: TESTS_S ...) so that the whole fits 10 minutes.
# Keep `--depths --sample-every` (empty: off) on every overhead.py call: their defaults fit
# 1,000-layer models, which take longer than the whole run's limit.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, triton, pytorch_lightning as pl; print('torch', torch.__version__, 'triton', triton.__version__, 'lightning', pl.__version__, torch.cuda.get_device_name())"
  date -u
} 2>&1 | tee -a "$OUT/log.txt"
timeout "${TESTS_S:-60}" python3 -m pytest -q -p no:cacheprovider -o addopts=-ra \
  tests/test_cuda.py tests/test_alarm_rules.py tests/test_layer_time.py tests/test_precision.py \
  tests/test_distributed.py tests/test_quiet_step_pointer_norms.py tests/test_quiet_step_read.py \
  tests/test_quiet_step_grouped_norms.py \
  -k "cuda or fsdp_fit_is_refused or pointer or quiet_step_read or grouped" \
  2>&1 | tee -a "$OUT/log.txt" | tail -n 25
timeout "${QUIET_S:-70}" python3 benchmarks/quiet_step.py --accelerator cuda --model launch \
  --steps 300 --rounds 2 2>&1 | tee -a "$OUT/log.txt" | tail -n 8
timeout "${GRAPH_S:-40}" python3 benchmarks/graph_probe.py \
  --models launch transformer resnet50 gpt2 2>&1 | tee -a "$OUT/log.txt" | tail -n 8
ONLY=(=GradFlowCallback "=all, defaults" "floor: one gradient read")
timeout "${SMALL_S:-110}" python3 benchmarks/overhead.py --accelerator cuda --rounds 2 \
  --models launch mlp cnn transformer --depths --sample-every --only "${ONLY[@]}" \
  --save --out "$OUT/small" 2>&1 \
  | tail -n 40
for model in resnet50 gpt2; do  # one call each: one call for both runs past 170 s
  timeout "${LARGE_S:-150}" python3 benchmarks/overhead.py --accelerator cuda \
    --precision bf16-mixed --rounds 2 --models "$model" --depths --sample-every \
    --only =GradFlowCallback "=all, defaults" --save --out "$OUT/large_$model" \
    2>&1 | tail -n 40
done
