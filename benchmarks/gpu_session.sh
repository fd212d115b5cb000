#!/usr/bin/env bash
# A lent GPU's checks, as one prepared run (issue 36): the CUDA tests, then the overhead tables
# on the small launch-bound models (fp32) and on ResNet-50 and GPT-2 124M (bf16-mixed).
# Run from the repository root on the GPU machine, whose python3 holds torch, Lightning,
# torchvision and transformers; results go to $OUT (default ./gpu_out).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, pytorch_lightning as pl; print('torch', torch.__version__, 'lightning', pl.__version__, torch.cuda.get_device_name())"
  date -u
} 2>&1 | tee "$OUT/env.txt"
timeout "${TESTS_S:-170}" python3 -m pytest -q -p no:cacheprovider -o addopts=-ra \
  tests/test_cuda.py tests/test_alarm_rules.py tests/test_layer_time.py tests/test_precision.py \
  tests/test_distributed.py::test_fsdp_fit_is_refused_before_training 2>&1 | tee "$OUT/tests.txt" | tail -n 25
ONLY=(=GradFlowCallback "=all, defaults" "floor: one gradient read" "=tutorial (.item() hooks)")
timeout "${SMALL_S:-190}" python3 benchmarks/overhead.py --accelerator cuda --rounds 3 \
  --models launch mlp cnn transformer --depths --sample-every --only "${ONLY[@]}" \
  --save --out "$OUT/small" 2>&1 | tail -n 40
timeout "${LARGE_S:-200}" python3 benchmarks/overhead.py --accelerator cuda --precision bf16-mixed \
  --rounds 3 --models resnet50 gpt2 --depths --sample-every --only "${ONLY[@]:0:3}" \
  --save --out "$OUT/large" 2>&1 | tail -n 40
