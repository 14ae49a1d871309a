#!/bin/bash
# #79 item 7 / #80 item 4: Qwen2.5-Coder-0.5B on (c) cloze's test split, read once after the choice: full prefill,
# the default (infoflow with the 0.5 TTFT budget, the plain store Qwen's default is) and the former one, every question
cd /work/runs
export OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 MKL_NUM_THREADS=1
lscpu | grep "Model name"; date
sparsecache bench fidelity --model qwen2.5-coder-0.5b --format cloze --workdir /work/runs/qcloze-test \
  --k 8 --questions 60 --split test --methods "infoflow+ttft_budget=0.5,infoflow:0.1,none" --json > qcloze-test.json
echo "rc=$? $(date)"
