#!/bin/bash
# #79 item 1 on SmolLM2, format (a) dev, k = 8, the first 150 questions: the default's split first (none and
# infoflow 0.1 over the wrapped store's codes and over exact fp16 KV), then r = 0.25 / 0.5, then unwrapped.
# #69's suite and full-prefill rows reused; resumes by label.
cd /work/runs
lscpu | grep "Model name"; date
sparsecache bench fidelity --workdir /work/runs/dec-a-dev --k 8 --questions 2000 --entities 320 --filler 4 --split dev \
  --limit 682 --confident-only --wrapper shipped --methods "none@wrapped,none:0+source=raw@wrapped,infoflow:0.1@wrapped,infoflow:0.1+source=raw@wrapped,infoflow:0.25@wrapped,infoflow:0.25+source=raw@wrapped,infoflow:0.5@wrapped,infoflow:0.5+source=raw@wrapped,none,raw" --json > /work/runs/dec-a-dev-confident.json
echo "rc=$? $(date)"
