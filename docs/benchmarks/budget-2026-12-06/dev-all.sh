#!/bin/bash
# #79 item 4: same-answer with power on (a) dev: the new default and the former one on all 682 questions of #69's dev suite
# (full prefill's rows reused), so same-answer's interval is about +-4 points
cd /work/runs
export OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 MKL_NUM_THREADS=1
lscpu | grep "Model name"; date
sparsecache bench fidelity --workdir /work/runs/i5-dev --k 8 --questions 2000 --entities 320 --filler 4 --split dev \
  --limit 682 --wrapper shipped --methods "infoflow+ttft_budget=0.5@wrapped,infoflow:0.1@wrapped" --json > devall.json
echo "rc=$? $(date)"
