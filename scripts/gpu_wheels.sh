#!/usr/bin/env bash
# The cp312 wheels the offline GPU image lacks, pinned once for every staging script (`gpu_stage.sh`,
# `gpu_stage_shapes.sh`): zarr and its codecs, gguf, platformdirs, and transformers 5.19 (the image's
# 5.17 computes Gemma 3 wrongly). Extra pins after DIR are added (the shapes' faiss-cpu).
#   bash scripts/gpu_wheels.sh DIR [PACKAGE==VERSION ...]
set -euo pipefail
D=$1; shift
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$D" \
  transformers==5.19.0 zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0 gguf==0.19.0 \
  platformdirs==4.14.8 "$@"
