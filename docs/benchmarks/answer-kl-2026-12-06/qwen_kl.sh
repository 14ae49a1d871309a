#!/bin/bash
cd /work/runs
lscpu | grep "Model name"; date
sparsecache bench fidelity --model qwen2.5-coder-0.5b --workdir qfid-small --k 8 --questions 100 --split dev \
  --wrapper /work/runs/qwen-wrapper-h16-t0 --methods "none@wrapped" --limit 1
S=/work/main/scripts/experiments/answer_kl.py
python $S qfid-small puzzle/q27-wrapped.json --questions 27 --store store-wrapped \
  --config 'wnone={"method":"none"}' --config 'winfo.1={"method":"infoflow","recompute_ratio":0.1}'
python $S qfid-small puzzle/q27-plain.json --questions 27 --store store \
  --config 'pnone={"method":"none"}' --config 'pinfo.1={"method":"infoflow","recompute_ratio":0.1}'
date; echo done
