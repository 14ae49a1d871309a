#!/bin/bash
# #94 item 3 on Qwen (item 5): the learned trailer, linked, as SmolLM2's (linked.sh: 8 link tokens, 150 steps, neutral
# data, the model frozen) but without the header, since Qwen's default store is plain (the neutral header cost it
# answers, +7/-24). Checkpoints every 25 steps: rerun this script to resume after a stop.
cd /work/runs
W=/work/runs/wrap-linked-qwen-t8
R=""; [ -f $W/checkpoint.pt ] && R="--resume"
lscpu | grep "Model name"; date
sparsecache learn-wrapper --model qwen2.5-coder-0.5b --out $W --header 0 --trailer 8 --linked --steps 150 \
  --eval-every 25 $R
echo "learned rc=$? $(date)"
