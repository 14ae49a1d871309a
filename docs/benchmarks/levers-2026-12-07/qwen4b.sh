#!/bin/bash
# qwen4.sh's last two-chunk rows (the gates over SmolLM2's budget on q-s2c), started on the core part B left free at
# 00:08 so that they end within the session; qwen4.sh's part A then finds them answered (rows resume).
cd /work/runs
export OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1
S="--model qwen2.5-coder-0.5b --k 8 --questions 2000 --entities 320 --filler 4 --split dev --confident-only"
M="infoflow+ttft_budget=0.5+gate_coverage=0.8,infoflow+ttft_budget=0.5+gate_margin=3"
sparsecache bench fidelity $S --workdir q-s2c --limit 200 --two-chunk placed --methods "$M" --json > q-s2c-gates2b.json
echo "rc=$? $(date)"
