#!/bin/bash
# #79 item 5: #69's dev suite (format (a), k = 8), its full-prefill and candidate rows reused; the TTFT budget as candidates
cd /work/runs
export OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 MKL_NUM_THREADS=1
lscpu | grep "Model name"; date
sparsecache bench fidelity --workdir /work/runs/i5-dev --k 8 --questions 2000 --entities 320 --filler 4 --split dev \
  --limit 682 --confident-only --wrapper shipped \
  --methods "infoflow+ttft_budget=0.5@wrapped,infoflow+ttft_budget=0.4@wrapped,infoflow:0.2@wrapped,infoflow:0.25@wrapped" --json > i5-dev.json
echo "rc=$? $(date)"
