#!/bin/bash
# #94 item 6: the one combination the rule had not seen, chunkflow on the stores encoded after each chunk's nearest
# neighbour (after.sh's nb-i5/nb-s2c for SmolLM2, qwen2.sh's qnb-i5/qnb-s2c for Qwen), on the questions each model's
# other candidates answered (SmolLM2: all 682 one-chunk and 400 two-chunk dev questions; Qwen: the first 341 and
# 200, as qwen3.sh). Its TTFT is chunkflow's on the plain store (the same query path): ttft.sh, qttft2.sh. Rows resume.
set -e
cd /work/runs
lscpu | grep "Model name"; date
S="--k 8 --questions 2000 --entities 320 --filler 4 --split dev --confident-only"
M="chunkflow+ttft_budget=0.5"
sparsecache bench fidelity $S --workdir nb-i5 --wrapper shipped --limit 682 --methods "$M@wrapped" --json > nb-i5-flow.json
sparsecache bench fidelity $S --workdir nb-s2c --wrapper shipped --two-chunk placed --limit 400 --methods "$M@wrapped" \
  --json > nb-s2c-flow.json
echo "smollm2 rc=$? $(date)"
Q="--model qwen2.5-coder-0.5b"
sparsecache bench fidelity $S $Q --workdir qnb-i5 --two-chunk retrieval --limit 341 --methods "$M" --json > qnb-i5-flow.json
sparsecache bench fidelity $S $Q --workdir qnb-s2c --two-chunk placed --limit 200 --methods "$M" --json > qnb-s2c-flow.json
echo "qwen rc=$? $(date)"
