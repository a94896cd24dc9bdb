#!/usr/bin/env bash
# streamoe on the H200 machine with MLX's CUDA backend (shared/device/README.md installs MLX into /root/site;
# the project runs from the repository root: no install needed). Writes results under $OUT. From the repo root:
#   bash bench/h200.sh setup     # synth + convert the full-size checkpoint (q4,q3) into /root/bench
#   bash bench/h200.sh gputest   # the GPU exactness tests (pytest -m gpu) on a small synthetic checkpoint
#   bash bench/h200.sh compare   # streamoe vs stock mlx-lm side by side: resident and --cap 4 (q4), --cap 4 (q3); the capped
#                                runs twice, interleaved with the pre-session-8 read-ahead schedule (guesswait)
#   bash bench/h200.sh prepare   # setup and gputest side by side (a fresh machine compiles kernels for minutes)
#   bash bench/h200.sh capped    # streamoe alone at --cap 4, q4 and q3 (when only the streamed path changed)
#   bash bench/h200.sh fill      # a record's copy into its slot against the disk read (upload-ring advice off / on)
#   bash bench/h200.sh parts     # a resident decode step part by part (mixers, MoE block, head) against mlx-lm's modules
#   bash bench/h200.sh save-kernels  # MLX's compiled CUDA kernels and the driver's cache -> $OUT/kernel-cache.tgz
# A fresh machine spends ~3 minutes compiling kernels on its first runs. `prepare` saves what it compiled to
# $OUT/kernel-cache.tgz; kept here as .gpu/kernel-cache.tgz (ignored) and carried (carry: [".gpu"]), every
# command restores it first on a machine that has none, so only kernels whose source changed compile again.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
S=/root/bench
OUT=${OUT:-/tmp/out}
mkdir -p "$S" "$OUT"
export PYTHONPATH=/root/site:$REPO PYTHONUNBUFFERED=1 CUDA_CACHE_PATH=/root/.nv/ComputeCache
cd "$REPO"
KCACHE=(/tmp/mlx /root/.nv/ComputeCache)  # MLX's default MLX_PTX_CACHE_DIR is /tmp/mlx/<version>/ptx
if [ -f .gpu/kernel-cache.tgz ] && [ ! -d /tmp/mlx ]; then
  tar -xzf .gpu/kernel-cache.tgz -C / && echo "kernel cache restored: $(du -sh /tmp/mlx | cut -f1)"
fi
case "$1" in
  save-kernels)
    dirs=(); for d in "${KCACHE[@]}"; do [ -d "$d" ] && dirs+=("${d#/}"); done
    [ ${#dirs[@]} -eq 0 ] || { tar -czf "$OUT/kernel-cache.tgz" -C / "${dirs[@]}" && ls -la "$OUT/kernel-cache.tgz"; }
    ;;
  setup)
    [ -f "$S/full-ckpt/model.safetensors.index.json" ] || python3 -m streamoe.cli synth "$S/full-ckpt" --size full 2>/dev/null
    [ -f "$S/full-conv/manifest.json" ] || python3 -m streamoe.cli convert "$S/full-ckpt" "$S/full-conv" --experts q4,q3 2>/dev/null
    ;;
  gputest)
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/gputest.log"
    ;;
  prepare)
    bash "$0" setup > "$OUT/setup.log" 2>&1 &
    status=0; bash "$0" gputest || status=$?  # a failing test still leaves the checkpoint and the kernels
    wait
    bash "$0" save-kernels
    exit $status
    ;;
  capped)
    for q in q4 q3; do
      python3 -m bench.gpu_compare --ckpt "$S/full-ckpt" --model "$S/full-conv" --caps 4 --experts $q --skip-mlx-lm \
        --out "$OUT/gpu-capped-$q.json" | grep -v '^ '
    done
    ;;
  fill)
    python3 -m bench.fill --model "$S/full-conv" --experts q4 --name "$OUT/fill-h200" | tail -30
    ;;
  parts)
    python3 -m bench.gpu_parts --ckpt "$S/full-ckpt" --model "$S/full-conv" --experts q4 --out "$OUT/gpu-parts-q4.json"
    ;;
  compare)
    python3 -m bench.gpu_compare --ckpt "$S/full-ckpt" --model "$S/full-conv" --caps resident,4 --experts q4 \
      --ablate guesswait@4 --rounds 2 --out "$OUT/gpu-compare-q4.json" | grep -v '^ '
    python3 -m bench.gpu_compare --ckpt "$S/full-ckpt" --model "$S/full-conv" --caps 4 --experts q3 --skip-mlx-lm \
      --ablate guesswait@4 --rounds 2 --out "$OUT/gpu-compare-q3.json" | grep -v '^ '
    ;;
esac
