#!/usr/bin/env bash
# Retake the README's dashboard screenshots from a real TensorBoard in headless Chromium.
# Usage: ./dev demo && docs/screenshots.sh [LOGDIR]   (needs `chromium`; loopback only)
set -euo pipefail
cd "$(dirname "$0")/.."
LOGDIR=${1:-runs}
PY=${PYTHON:-.venv/bin/python}
PORT=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
setsid "$PY" -m tensorboard.main --logdir "$LOGDIR" --host 127.0.0.1 --port "$PORT" >/dev/null 2>&1 &
TB=$!
trap 'kill -- -$TB 2>/dev/null || true' EXIT
for _ in $(seq 60); do curl -sf "http://127.0.0.1:$PORT/data/runs" >/dev/null && break; sleep 0.5; done

shot() {  # shot NAME FRAGMENT WIDTH,HEIGHT
  local profile raw
  profile=$(mktemp -d)
  raw=$(mktemp --suffix=.png)
  chromium --headless --no-sandbox --disable-gpu --disable-background-networking \
    --disable-component-update --disable-sync --no-first-run --user-data-dir="$profile" \
    --hide-scrollbars --virtual-time-budget=15000 --window-size="$3" --screenshot="$raw" \
    "http://127.0.0.1:$PORT/#$2" >/dev/null 2>&1
  # 128-colour palette: the same picture at a third of the size.
  "$PY" -c "import sys; from PIL import Image; Image.open(sys.argv[1]).convert('RGB').quantize(128).save(sys.argv[2], optimize=True)" "$raw" "docs/$1"
  rm -rf "$profile" "$raw"
  echo "docs/$1"
}
shot dashboard-custom.png custom_scalars 1400,900
shot dashboard-images.png images 1400,1000
shot dashboard-histograms.png histograms 1400,700
