#!/bin/bash
# #94 item 5, after qwen.sh's one-chunk prefix-store rows (qwen.sh was stopped there, 2026-12-07 14:10): on Qwen the
# neutral wrapper costs the default answers (64% kept against the plain store's 75%), and Qwen's default store is
# plain, so its neighbours candidate is a PLAIN store encoded after each chunk's nearest neighbour (qnb-dev/store),
# not a wrapped one. Rows resume; the same workdirs and questions as qwen.sh. (Restarted at 14:23 with the neighbours
# store first, for time: every row is ~5 s, 24 tokens generated and 24 teacher-forced, whatever the method.) Restarted 2026-12-07 16:00 with the two-chunk questions before the r = 0 rows
# (reference only: not at the budget), and without the wrapped store on two-chunk questions: on one-chunk ones it
# lost to the plain store by +7/-24 (p = 0.003); and on the first 200 of the 400 placed two-chunk questions (full
# prefill on all of them took ~12 s a row beside another job: 400 would take 80 min).
set -e
cd /work/runs
B=/work/main/docs/benchmarks
Q=qwen2.5-coder-0.5b
lscpu | grep "Model name"; date
if [ ! -f qnb-dev/encode.json ]; then
  mkdir -p qnb-dev
  sparsecache encode-corpus q-i5/corpus.jsonl --store qnb-dev/store --model $Q --wrapper none \
    --encode-after neighbours --json > qnb-dev/encode.json 2> qnb-dev/encode.log
fi
echo "neighbours store encoded $(date)"
workdir() {  # $1: the prefix-store workdir, $2: its neighbours copy (the plain store swapped, full prefill's rows kept)
  mkdir -p $2
  cp $1/{corpus.jsonl,questions.json,suite.json} $2/
  [ -d $2/store ] || cp -r qnb-dev/store $2/store
  [ -d $2/store-wrapped ] || cp -r $1/store-wrapped $2/store-wrapped
  [ -f $2/results.json ] || python -c "
import json, sys
rows = json.load(open(sys.argv[1]))['rows']
json.dump({'rows': [r for r in rows if r['label'] == 'full']}, open(sys.argv[2], 'w'))
" $1/results.json $2/results.json
}
workdir q-i5 qnb-i5
S="--model $Q --workdir qnb-i5 --k 8 --questions 2000 --entities 320 --filler 4 --split dev --limit 682 --two-chunk retrieval"
sparsecache bench fidelity $S --confident-only --methods "infoflow+ttft_budget=0.5" --json > qnb-i5.json
echo "one-chunk, neighbours store, the default rc=$? $(date)"
python $B/levers-2026-12-07/prepare_model.py q-i5 q-s2c 400 $Q
S="--model $Q --workdir q-s2c --k 8 --questions 2000 --entities 320 --filler 4 --split dev --two-chunk placed --limit 200"
sparsecache bench fidelity $S --confident-only --methods "infoflow+ttft_budget=0.5" \
  --json > q-s2c.json
echo "two-chunk, prefix stores rc=$? $(date)"
workdir q-s2c qnb-s2c
S="--model $Q --workdir qnb-s2c --k 8 --questions 2000 --entities 320 --filler 4 --split dev --two-chunk placed --limit 200"
sparsecache bench fidelity $S --confident-only --methods "infoflow+ttft_budget=0.5" --json > qnb-s2c.json
echo "two-chunk, neighbours store rc=$? $(date)"
# (r = 0 for reference moved to qwen3.sh, after the levers)
