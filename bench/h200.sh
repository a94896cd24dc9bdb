#!/usr/bin/env bash
# The full-size synthetic checkpoint on the H200 machine with MLX's CUDA backend (see shared/device/README.md
# for installing MLX there). Writes bench JSON results under $OUT. Usage on the device, from the repo root:
#   PYTHONPATH=/root/site:$PWD bash bench/h200.sh setup     # synth + convert (q4,q3) into /root/bench
#   PYTHONPATH=/root/site:$PWD bash bench/h200.sh decode    # caps 3, 4, 6 and everything resident
set -euo pipefail
S=/root/bench
mkdir -p "$S" "${OUT:-/tmp/out}"
py() { python3 "$@"; }
case "$1" in
  setup)
    [ -f "$S/full-ckpt/model.safetensors.index.json" ] || (time py -m streamoe.cli synth "$S/full-ckpt" --size full 2>/dev/null)
    [ -f "$S/full-conv/manifest.json" ] || (time py -m streamoe.cli convert "$S/full-ckpt" "$S/full-conv" --experts q4,q3 2>/dev/null)
    py -m streamoe.cli plan "$S/full-conv" --cap 4 --ctx 4096 | tee "$OUT/plan-cap4.txt"
    ;;
  decode)
    py bench/decode.py --model "$S/full-conv" --caps "${CAPS:-3,4,6,resident}" --tokens "${TOKENS:-32}" --ctx 2048 \
      --experts "${EXPERTS:-q4}" --scratch "$S" --name "decode-h200-${EXPERTS:-q4}" 2>&1 | tail -n 80
    cp bench/results/decode-h200-*.json "$OUT/"
    ;;
esac
