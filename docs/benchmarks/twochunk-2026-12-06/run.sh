#!/bin/bash
# #79 item 4 on SmolLM2: the two-chunk questions of #69's dev entity suite (a workdir W made by `bench fidelity --k 8
# --questions 2000 --entities 320 --filler 4 --split dev`, its stores encoded) with contexts placed: both needed chunks among
# retrieval's look-alikes at the 3rd and 5th of 8. prepare.py writes the new workdir (same corpus and stores); the first 24 ran, then the first 160 (below).
cd /work/runs   # prepare.py reads i5-dev (the dev suite's workdir) and writes s2c-dev
python prepare.py 200
S="--workdir s2c-dev --k 8 --questions 2000 --entities 320 --filler 4 --split dev --two-chunk placed --wrapper shipped --limit 24"
sparsecache bench fidelity $S --methods "infoflow+ttft_budget=0.5@wrapped,infoflow:0.1@wrapped,none@wrapped" --json
# later: the first 160, the default on every question, the other rows on the confident ones (rows resume)
python prepare.py 400
S="--workdir s2c-dev --k 8 --questions 2000 --entities 320 --filler 4 --split dev --two-chunk placed --wrapper shipped --limit 160"
sparsecache bench fidelity $S --methods "infoflow+ttft_budget=0.5@wrapped" --json
sparsecache bench fidelity $S --confident-only --methods "infoflow+ttft_budget=0.5@wrapped,infoflow:0.1@wrapped,none@wrapped" --json
# later: all 400 (the same two passes with --limit 400; rows resume)
S="--workdir s2c-dev --k 8 --questions 2000 --entities 320 --filler 4 --split dev --two-chunk placed --wrapper shipped --limit 400"
sparsecache bench fidelity $S --methods "infoflow+ttft_budget=0.5@wrapped" --json
sparsecache bench fidelity $S --confident-only --methods "infoflow+ttft_budget=0.5@wrapped,infoflow:0.1@wrapped,none@wrapped" --json
python ../main/docs/benchmarks/qwen-test-2026-12-06/summarise.py s2c-dev/results.json smollm2-dev-placed-summary.json
