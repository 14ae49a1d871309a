#!/bin/bash
# #79 item 1 on format (c): SmolLM2, cloze over the demo corpus, dev, k = 8; each method over the codes and exact K/V
cd /work/runs
export OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 MKL_NUM_THREADS=1
sparsecache bench fidelity --format cloze --workdir "$1" --k 8 --questions 71 --split dev \
  --wrapper shipped --methods "none,none@wrapped,none:0+source=raw@wrapped,infoflow:0.1@wrapped,infoflow:0.1+source=raw@wrapped,infoflow:0.25@wrapped,infoflow:0.25+source=raw@wrapped,infoflow:0.5@wrapped,infoflow:0.5+source=raw@wrapped" \
  --json > scloze-dev.json
echo rc=$? > scloze-dev.rc
