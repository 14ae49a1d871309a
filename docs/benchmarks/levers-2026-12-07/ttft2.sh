#!/bin/bash
# TTFT of gates2.sh's and after.sh's candidates beside full prefill and the default in one run, the CPU to itself:
# the first 10 questions of #69's dev suite, as ttft.sh. "+prefill_under=0" (what a benchmark label means anyway)
# gives each label a name of its own, so these rows are timed now and not read back from ttft.sh's run.
cd /work/runs
lscpu | grep "Model name"; date; uptime
P="+prefill_under=0"
M="full+first_layer=tokens$P,infoflow+ttft_budget=0.5$P@wrapped,infoflow+ttft_budget=0.4+gate_coverage=0.8$P@wrapped"
M="$M,infoflow+ttft_budget=0.35+gate_coverage=0.8$P@wrapped"
sparsecache bench fidelity --workdir i5-dev --k 8 --questions 2000 --entities 320 --filler 4 --split dev --limit 10 \
  --wrapper shipped --methods "$M" --json > i5-ttft2.json
echo "prefix store rc=$? $(date)"; uptime
# the store encoded after neighbours: the same query path, so the same time is expected; measured, not assumed
M="full+first_layer=tokens$P,infoflow+ttft_budget=0.5$P@wrapped"
sparsecache bench fidelity --workdir nb-i5 --k 8 --questions 2000 --entities 320 --filler 4 --split dev --limit 10 \
  --wrapper shipped --methods "$M" --json > nb-ttft2.json
echo "neighbours store rc=$? $(date)"; uptime
