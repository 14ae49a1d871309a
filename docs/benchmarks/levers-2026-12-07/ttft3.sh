#!/bin/bash
# #94 item 6: chunkflow's TTFT on the store encoded after each chunk's nearest neighbour, beside full prefill and the
# default in one run, the CPU to itself: the first 10 dev questions (as ttft2.sh), in a copy of nb-i5 without its
# rows (nb-t3), so that every label is timed in this run and not read back.
cd /work/runs
mkdir -p nb-t3
cp nb-i5/{corpus.jsonl,questions.json,suite.json} nb-t3/
[ -d nb-t3/store ] || cp -r nb-i5/store nb-t3/store
[ -d nb-t3/store-wrapped ] || cp -r nb-i5/store-wrapped nb-t3/store-wrapped
lscpu | grep "Model name"; date; uptime
P="+prefill_under=0"
M="full+first_layer=tokens$P,infoflow+ttft_budget=0.5$P@wrapped,chunkflow+ttft_budget=0.5$P@wrapped"
sparsecache bench fidelity --workdir nb-t3 --k 8 --questions 2000 --entities 320 --filler 4 --split dev --limit 10 \
  --wrapper shipped --methods "$M" --json > nb-ttft3.json
echo "rc=$? $(date)"; uptime
