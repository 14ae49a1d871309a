#!/usr/bin/env bash
# #82 item 4 on a lent GPU in ONE piece: the timing-only shapes need no real weights, so instead of the
# default model's GGUF and the embedder's zip (180 MB, four calls) this stages the wheels the GPU image
# lacks and the two models' configs and tokenizers. On the machine the SmolLM2 directory gets an empty
# weights file (the random shapes read only its tokenizer) and the embedder random weights of its own
# config (it only places chunks in the index; nothing timed depends on which chunk is retrieved).
#   here:   bash scripts/gpu_stage_shapes.sh pack DIR      (DIR: an ignored folder in the repository, carried)
#   there:  bash scripts/gpu_stage_shapes.sh unpack DIR && bash scripts/gpu_run.sh shapes SECONDS SHAPES
# Move the tracked dictionaries/ and docs/benchmarks/ out of the tree while the call runs (64 MiB per call).
set -euo pipefail
D=$2
case $1 in
pack)
  rm -rf "$D"; mkdir -p "$D/whl" "$D/smol" "$D/emb"
  bash "$(dirname "$0")/gpu_wheels.sh" "$D/whl" faiss-cpu==1.15.1
  smol=$(python3 -c "from sparsecache.model.gguf import model_dir; print(model_dir())")
  emb=$(python3 -c "from sparsecache.kvstore.index import default_embedder_dir; print(default_embedder_dir())")
  (cd "$smol" && cp config.json generation_config.json tokenizer*.json chat_template.jinja "$D/smol/")
  (cd "$emb" && tar cf - --exclude=model.safetensors .) | tar xf - -C "$D/emb"
  du -sh "$D"
  ;;
unpack)
  C=/tmp/sc-cache/models; mkdir -p $C /tmp/site
  [ -n "${NO_WHEELS:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$D"/whl/*.whl  # (NO_WHEELS=1: the CPU try)
  smol=$(PYTHONPATH=/tmp/site:$PWD SPARSECACHE_CACHE=/tmp/sc-cache python3 -c \
    "from sparsecache.model.gguf import DEFAULT_NAME; print(DEFAULT_NAME)" 2>/dev/null || echo SmolLM2-135M-Instruct)
  mkdir -p "$C/$smol" && cp "$D"/smol/* "$C/$smol/" && : > "$C/$smol/model.safetensors"
  cp -r "$D/emb" "$C/all-MiniLM-L6-v2"
  PYTHONPATH=/tmp/site python3 -c "
import sys, torch, transformers
torch.manual_seed(0); p = sys.argv[1]
transformers.AutoModel.from_config(transformers.AutoConfig.from_pretrained(p)).save_pretrained(p)" "$C/all-MiniLM-L6-v2"
  ls -la "$C"/*
  ;;
esac
