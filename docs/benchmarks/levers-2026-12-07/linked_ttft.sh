#!/bin/bash
# #94 item 3: the linked-trailer store's TTFT beside full prefill in one run, the CPU to itself (other jobs stopped
# with kill -STOP for it): the first 10 dev questions, as ttft2.sh for the neutral stores.
cd /work/runs
lscpu | grep "Model name"; date; uptime
P="+prefill_under=0"
M="full+first_layer=tokens$P,infoflow+ttft_budget=0.5$P@wrapped"
sparsecache bench fidelity --workdir lk-i5 --k 8 --questions 2000 --entities 320 --filler 4 --split dev --limit 10 \
  --wrapper /work/runs/wrap-linked-h16-t8 --methods "$M" --json > lk-ttft.json
echo "rc=$? $(date)"; uptime
