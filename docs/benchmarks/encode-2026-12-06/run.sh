#!/bin/bash
# #82 item 3, 2026-12-06: the CPU encode's forward in bfloat16, and what else was tried (2-vCPU AMD EPYC, quiet; run
# from the repository root). BENCHMARKS.md, "The CPU encode's OMP, phase by phase", says what each file shows.
E=docs/benchmarks/encode-2026-12-06
python $E/fwd_probe.py $E/forward-gemm-probe.json       # forward (8.4K tokens) and alpha0 GEMM, float32 against bfloat16
python $E/bf16_kv.py                                    # NMSE of a bfloat16 forward's K/V against float32's (writes to the cwd)
python $E/sweep.py                                      # the screening's candidates and refresh: time and NMSE
D=sparsecache/dictionaries/smollm2-135m-n8192-s80-L10
sparsecache eval-dict $D --forward-dtype float32 --json > $E/eval-dict-forward-float32.json
sparsecache eval-dict $D --forward-dtype bfloat16 --json > $E/eval-dict-forward-bfloat16.json
# the README's demo encode, fresh stores, one after the other
sparsecache encode-corpus builtin:heldout --store /tmp/demo-f32.store --forward-dtype float32 --json > $E/demo-encode-float32.json
sparsecache encode-corpus builtin:heldout --store /tmp/demo-bf16.store --json > $E/demo-encode-auto-bfloat16.json
NUMBA_THREADING_LAYER=workqueue sparsecache encode-corpus builtin:heldout --store /tmp/demo-wq.store --json \
  > $E/demo-encode-auto-bfloat16-workqueue.json
NUMBA_THREADING_LAYER=workqueue sparsecache encode-corpus builtin:heldout --store /tmp/demo-wq32.store --forward-dtype float32 \
  --json > $E/demo-encode-float32-workqueue.json
NUMBA_THREADING_LAYER=omp python $E/real2.py /tmp/demo-f32.store        # the forward after numba's pool has run: omp layer
NUMBA_THREADING_LAYER=workqueue python $E/real2.py /tmp/demo-f32.store  # ... workqueue layer
bash $E/ttft_layers.sh /tmp/demo-f32.store                # the README's query under each numba layer (JSON by hand)
# omp-bf16-selection.json: a bfloat16 alpha0 for the atom choice with exact correlations at the chosen atoms (a kernel
# patch measured and reverted: 5% faster OMP at +0.8% K NMSE)
