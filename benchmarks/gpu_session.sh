#!/usr/bin/env bash
# A lent GPU's checks (issue 36), in two parts that each fit one call of the device tool:
#   part 1: the CUDA tests, the quiet step's host time in our hooks against the floor's
#           (quiet_step.py), what a CUDA graph of the norm pass would save (graph_probe.py),
#           then the overhead table on the launch-bound stand-in and the small models (fp32);
#   part 2: the overhead table on ResNet-50 and GPT-2 124M (bf16-mixed), and their sampled step
#           against a quiet one (sampled_step_gpu.py).
# Run from the repository root on the GPU machine, whose python3 holds torch, Lightning,
# torchvision and transformers; results go to $OUT (default ./gpu_out). Usage:
#   bash benchmarks/gpu_session.sh 1 && bash benchmarks/gpu_session.sh 2
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu_out}
PART=${1:-1}
mkdir -p "$OUT"
ONLY=(=GradFlowCallback "=all, defaults" "floor: one gradient read" "=tutorial (.item() hooks)")
if [ "$PART" = 1 ]; then
  {
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
    python3 -c "import torch, pytorch_lightning as pl; print('torch', torch.__version__, 'lightning', pl.__version__, torch.cuda.get_device_name())"
    git log -1 --format='%h %s' 2>/dev/null
    date -u
  } 2>&1 | tee "$OUT/env.txt"
  timeout "${TESTS_S:-130}" python3 -m pytest -q -p no:cacheprovider -o addopts=-ra \
    tests/test_cuda.py tests/test_alarm_rules.py tests/test_layer_time.py tests/test_precision.py \
    tests/test_distributed.py -k "cuda or fsdp_fit_is_refused" 2>&1 | tee "$OUT/tests.txt" | tail -n 25
  timeout "${QUIET_S:-70}" python3 benchmarks/quiet_step.py --accelerator cuda --model launch \
    --steps 300 --rounds 2 2>&1 | tee "$OUT/quiet.txt" | tail -n 8
  timeout "${GRAPH_S:-45}" python3 benchmarks/graph_probe.py \
    --models launch transformer resnet50 gpt2 2>&1 | tee "$OUT/graph.txt" | tail -n 8
  timeout "${SMALL_S:-170}" python3 benchmarks/overhead.py --accelerator cuda --rounds 3 \
    --models launch mlp cnn transformer --depths --sample-every --only "${ONLY[@]}" \
    --save --out "$OUT/small" 2>&1 | tee "$OUT/small.log" | tail -n 40
else
  timeout "${LARGE_S:-190}" python3 benchmarks/overhead.py --accelerator cuda \
    --precision bf16-mixed --rounds 3 --models resnet50 gpt2 --depths --sample-every \
    --only "${ONLY[@]:0:3}" --save --out "$OUT/large" 2>&1 | tee "$OUT/large.log" | tail -n 40
  for model in resnet50 gpt2; do
    timeout "${SAMPLED_S:-60}" python3 benchmarks/sampled_step_gpu.py --model "$model" \
      --precision bf16-mixed --only bare GradFlowCallback all --top 0 2>&1 \
      | tee "$OUT/sampled_$model.txt" | tail -n 12
  done
fi
