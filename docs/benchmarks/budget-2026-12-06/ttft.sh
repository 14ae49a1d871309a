#!/bin/bash
# #79 item 5's TTFT: every candidate in one run, the CPU to itself (10 questions of the TTFT suite, ~1,130 tokens)
cd /work/runs
lscpu | grep "Model name"; date; uptime
sparsecache bench fidelity --workdir /work/runs/i5-ttft --k 8 --questions 600 --entities 110 --filler 4 --split dev \
  --limit 10 --wrapper shipped --methods "none@wrapped,infoflow:0.1@wrapped,infoflow:0.15@wrapped,infoflow:0.2@wrapped,infoflow:0.25@wrapped,infoflow+ttft_budget=0.4@wrapped,infoflow+ttft_budget=0.45@wrapped,infoflow+ttft_budget=0.5@wrapped,superposition:0.5+paths=2@wrapped,cacheblend:0.15@wrapped,infoflow:0.15,none" --json > i5-ttft.json
echo "rc=$? $(date)"; uptime
