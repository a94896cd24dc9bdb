#!/usr/bin/env bash
# The full-size synthetic checkpoint on the H200 machine with MLX's CUDA backend (see shared/device/README.md
# for installing MLX there into /root/site). Writes bench JSON results under $OUT. On the device, from the repo root:
#   bash bench/h200.sh install    # the project itself into /root/site (no index needed)
#   bash bench/h200.sh setup      # synth + convert (q4,q3) into /root/bench
#   bash bench/h200.sh decode     # caps 3, 4, 6 and everything resident (CAPS, TOKENS, EXPERTS override)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
S=/root/bench
OUT=${OUT:-/tmp/out}
mkdir -p "$S" "$OUT"
export PYTHONPATH=/root/site
cd /root  # not the repo root: its streamoe/ folder would shadow the installed package
case "$1" in
  install)
    python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /root/site "$REPO" 2>&1 | grep -v WARN || true
    python3 -c "import streamoe.runtime.engine, mlx.core as mx; print('streamoe ok on', mx.default_device())"
    ;;
  setup)
    [ -f "$S/full-ckpt/model.safetensors.index.json" ] || { time python3 -m streamoe.cli synth "$S/full-ckpt" --size full 2>/dev/null; }
    [ -f "$S/full-conv/manifest.json" ] || { time python3 -m streamoe.cli convert "$S/full-ckpt" "$S/full-conv" --experts "${CONVERT:-q4,q3}" 2>/dev/null; }
    python3 -m streamoe.cli plan "$S/full-conv" --cap 4 --ctx 4096 | tee "$OUT/plan-cap4.txt"
    ;;
  decode)
    python3 "$REPO/bench/decode.py" --model "$S/full-conv" --caps "${CAPS:-3,4,6,resident}" --tokens "${TOKENS:-32}" --ctx 2048 \
      --experts "${EXPERTS:-q4}" --scratch "$S" --name "decode-h200-${EXPERTS:-q4}" 2>&1 | grep -v '^ ' | tail -n 20
    cp "$REPO"/bench/results/decode-h200-*.json "$OUT/"
    ;;
esac
