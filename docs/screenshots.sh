#!/usr/bin/env bash
# Retake the README's dashboard screenshots from a real TensorBoard in headless Chromium, one per
# tab that matters, from the demo's runs. Look at every PNG before committing it.
# Usage: ./dev demo && docs/screenshots.sh [LOGDIR]
# Needs `chromium` (Debian: apt-get install chromium); serves on loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."
LOGDIR=${1:-runs}
PY=${PYTHON:-.venv/bin/python}
PORT=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
setsid "$PY" -m tensorboard.main --logdir "$LOGDIR" --host 127.0.0.1 --port "$PORT" >/dev/null 2>&1 &
TB=$!
trap 'kill -- -$TB 2>/dev/null || true' EXIT
for _ in $(seq 60); do curl -sf "http://127.0.0.1:$PORT/data/runs" >/dev/null && break; sleep 0.5; done

shot() {  # shot NAME URL-SUFFIX WIDTH,HEIGHT
  local profile raw
  profile=$(mktemp -d)
  raw=$(mktemp --suffix=.png)
  chromium --headless --no-sandbox --disable-gpu --disable-background-networking \
    --disable-component-update --disable-sync --no-first-run --user-data-dir="$profile" \
    --hide-scrollbars --virtual-time-budget=15000 --window-size="$3" --screenshot="$raw" \
    "http://127.0.0.1:$PORT/$2" >/dev/null 2>&1
  # 128-colour palette: the same picture at a third of the size.
  "$PY" -c "import sys; from PIL import Image; Image.open(sys.argv[1]).convert('RGB').quantize(128).save(sys.argv[2], optimize=True)" "$raw" "docs/$1"
  rm -rf "$profile" "$raw"
  echo "docs/$1"
}
# TensorBoard honours a tag filter in the URL (after the fragment): it keeps the page on the
# gradient flow. It does not take the smoothing from the URL: Custom Scalars smooths at 0.6.
shot dashboard-custom.png "#custom_scalars" 1400,1000
shot dashboard-images.png "#images&tagFilter=grad_flow" 1400,1180
shot dashboard-text.png "#text" 1400,800
shot dashboard-histograms.png "#histograms&tagFilter=grad_flow/grad_log10_abs/(features.0|classifier)" 1400,800
# Not Time Series: headless Chromium draws its charts empty (WebGL). Open it filtered to the
# gradient flow with http://localhost:6006/?tagFilter=grad_flow/grad_norm/#timeseries
