#!/usr/bin/env bash
# Here (not on the H200): the wheels bench/h200.sh's `stage` / `install` take to the GPU machine, in three ignored
# folders (.whl1, .whl2, .whl3), each small enough to travel beside the working tree (64 MiB a call, the tree
# included): MLX's CUDA build (89.8 MB) split in three, MLX, mlx-lm (the oracle) and the project's dependencies
# that machine lacks, and mlx-vlm (the expert-offload peer of `h200.sh peers`; transformers, pillow and tokenizers are
# there already).
#   bash bench/h200_wheels.sh     # then device runs, back to back: (carry .whl1) `bash bench/h200.sh stage`,
#                                 # (carry .whl2) `bash bench/h200.sh stage`, (carry .whl3) `bash bench/h200.sh install && ...`
set -euo pipefail
cd "$(dirname "$0")/.."
dl=$(mktemp -d) && trap 'rm -rf "$dl"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dl" \
  mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 zstandard jsonschema referencing jsonschema-specifications \
  rpds-py attrs xxhash llguidance uvloop httptools mlx-vlm==0.7.10 requests urllib3 idna certifi charset-normalizer
rm -rf .whl1 .whl2 .whl3 && mkdir -p .whl1 .whl2 .whl3
cp "$dl"/mlx-0.32.4-*.whl .whl1/
cuda=$(basename "$dl"/mlx_cuda_13-*.whl)  # split as NAME.part.aa/ab/ac: `install` joins them back into NAME
split -b 36M "$dl/$cuda" "$dl/$cuda.part."
mv "$dl/$cuda.part.aa" .whl1/ && mv "$dl/$cuda.part.ab" .whl2/ && mv "$dl/$cuda.part.ac" .whl3/
find "$dl" -name '*.whl' ! -name 'mlx-0.32*' ! -name 'mlx_cuda*' -exec cp {} .whl3/ \;
du -sh .whl1 .whl2 .whl3
