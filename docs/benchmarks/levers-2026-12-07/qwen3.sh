#!/bin/bash
# #94 item 5, after qwen2.sh: the levers SmolLM2 measured on its prefix store (run.sh, gates2.sh), now on Qwen's plain
# store, on the first half of the same one-chunk dev questions (q-i5, the first 341 of 682: at ~10 s a row beside
# another job, all 154 confident ones would take 80 minutes a lever) and the same two-chunk ones (q-s2c):
# chunkflow and legolink at the budget, the coverage gate over budget 0.4. Then r = 0 (reference only, not at the
# budget) on the plain and neighbours stores. Rows resume.
set -e
cd /work/runs
Q=qwen2.5-coder-0.5b
lscpu | grep "Model name"; date
M="chunkflow+ttft_budget=0.5,legolink+ttft_budget=0.5,infoflow+ttft_budget=0.4+gate_coverage=0.8"
S="--model $Q --k 8 --questions 2000 --entities 320 --filler 4 --split dev"
sparsecache bench fidelity $S --workdir q-i5 --limit 341 --two-chunk retrieval --confident-only --methods "$M" --json > q-i5-levers.json
echo "one-chunk levers rc=$? $(date)"
sparsecache bench fidelity $S --workdir q-s2c --limit 200 --two-chunk placed --confident-only --methods "$M" --json > q-s2c-levers.json
echo "two-chunk levers rc=$? $(date)"
sparsecache bench fidelity $S --workdir qnb-i5 --limit 682 --two-chunk retrieval --confident-only --methods none --json > qnb-i5-none.json
sparsecache bench fidelity $S --workdir q-i5 --limit 682 --two-chunk retrieval --confident-only --methods none --json > q-i5-none.json
echo "one-chunk, none rc=$? $(date)"
