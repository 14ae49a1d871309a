#!/bin/bash
# #94's TTFT: the same labels on the first 10 questions of #69's dev suite (~1,130 tokens), the CPU to itself
cd /work/runs
lscpu | grep "Model name"; date; uptime
# full prefill and none under second labels too: their recorded rows were timed on another day
M="full+first_layer=tokens,none+first_layer=tokens@wrapped,infoflow+ttft_budget=0.5+first_layer=tokens@wrapped,chunkflow+ttft_budget=0.5@wrapped,legolink+ttft_budget=0.5@wrapped,legolink:1@wrapped"
M="$M,infoflow:0.25+first_layer=tokens@wrapped,infoflow+ttft_budget=0.5+gate_coverage=0.8@wrapped,chunkflow+ttft_budget=0.5+gate_coverage=0.8@wrapped"
M="$M,infoflow+ttft_budget=0.5+gate_margin=1@wrapped,infoflow+ttft_budget=0.5+gate_margin=3@wrapped"
sparsecache bench fidelity --workdir i5-dev --k 8 --questions 2000 --entities 320 --filler 4 --split dev --limit 10 \
  --wrapper shipped --methods "$M" --json > i5-ttft-levers.json
echo "rc=$? $(date)"; uptime
