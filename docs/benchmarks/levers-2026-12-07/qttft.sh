#!/bin/bash
# #94 item 5: Qwen2.5-Coder-0.5B's TTFT of qwen.sh's candidates beside full prefill, the CPU to itself (other jobs
# stopped for it): the first 10 questions of #69's dev suite, as ttft2.sh for SmolLM2.
cd /work/runs
lscpu | grep "Model name"; date; uptime
P="+prefill_under=0"
M="full+first_layer=tokens$P,infoflow+ttft_budget=0.5$P,infoflow+ttft_budget=0.5$P@wrapped"
sparsecache bench fidelity --model qwen2.5-coder-0.5b --workdir q-i5 --k 8 --questions 2000 --entities 320 --filler 4 \
  --split dev --limit 10 --two-chunk retrieval --wrapper shipped --methods "$M" --json > q-ttft.json
echo "rc=$? $(date)"; uptime
