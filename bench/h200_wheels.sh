#!/usr/bin/env bash
# Here (not on the H200): the wheels bench/h200.sh's `stage` / `install` take to the GPU machine, in ignored folders,
# each small enough to travel beside the working tree (64 MiB a call, the tree's 17 MB included). MLX's CUDA build
# (an 89.8 MB wheel) goes unpacked and xz-compressed (75 MB), split in two: .whl1 and .whl2 carry it with MLX,
# mlx-lm (the oracle) and the project's dependencies that machine lacks, so a lease installs in two calls;
# .whl3 holds what only `h200.sh peers` needs (mlx-vlm, the expert-offload peer, and its own dependencies; the
# server's event loop), installed by any later call that carries it.
#   bash bench/h200_wheels.sh     # then device runs, back to back, each `STEPS=... bash bench/h200.sh lease`:
#                                 # carrying .whl1, then .whl2 (then .whl3 where `peers` runs)
set -euo pipefail
cd "$(dirname "$0")/.."
dl=$(mktemp -d) && trap 'rm -rf "$dl"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dl" \
  mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 zstandard jsonschema referencing jsonschema-specifications \
  rpds-py attrs xxhash llguidance uvloop httptools mlx-vlm==0.7.10 requests urllib3 idna certifi charset-normalizer
rm -rf .whl1 .whl2 .whl3 && mkdir -p .whl1 .whl2 .whl3 "$dl/cuda"
# the CUDA build's files as its wheel lays them out under site-packages (`install` extracts them there)
python3 -m zipfile -e "$dl"/mlx_cuda_13-*.whl "$dl/cuda"
tar cf - -C "$dl/cuda" . | xz -6 -T0 > "$dl/mlx_cuda.tar.xz"
split -n 2 "$dl/mlx_cuda.tar.xz" "$dl/mlx_cuda.tar.xz.part."  # .aa, .ab: `install` joins them
mv "$dl/mlx_cuda.tar.xz.part.aa" "$dl"/mlx-0.32.4-*.whl "$dl"/zstandard-*.whl .whl1/
mv "$dl/mlx_cuda.tar.xz.part.ab" "$dl"/mlx_lm-*.whl "$dl"/llguidance-*.whl "$dl"/xxhash-*.whl "$dl"/jsonschema*.whl \
  "$dl"/referencing-*.whl "$dl"/rpds_py-*.whl "$dl"/attrs-*.whl .whl2/
find "$dl" -maxdepth 1 -name '*.whl' ! -name 'mlx_cuda*' -exec mv {} .whl3/ \;
du -sh .whl1 .whl2 .whl3
