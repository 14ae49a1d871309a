#!/bin/bash
# #94 item 5: Qwen2.5-Coder-0.5B beside SmolLM2 on the candidates, on the same dev questions (format (a), k = 8):
# one-chunk: the first 682 questions of #69's dev suite, contexts as retrieval returns them (q-i5; full prefill's rows
# reused from #80's run on the first 940 of the same suite, docs/benchmarks/qwen80-2026-12-05); two-chunk: the first
# 400 two-chunk questions placed (q-s2c, full prefill on all 400). Stores: Qwen's plain store (its default), its
# neutral-wrapped store, and the wrapped store encoded after each chunk's nearest neighbour (qnb-dev). Every candidate
# row on full prefill's confident questions; one job at a time, torch's default threads (2 cores).
set -e
cd /work/runs
B=/work/main/docs/benchmarks
Q=qwen2.5-coder-0.5b
lscpu | grep "Model name"; date
mkdir -p q-i5
[ -f q-i5/results.json ] || python -c "
import json, sys
rows = json.load(open(sys.argv[1]))['rows']
first = {f'k8-{i:03d}' for i in range(682)}
json.dump({'rows': [r for r in rows if r['label'] == 'full' and r['question'] in first]}, open(sys.argv[2], 'w'))
" $B/qwen80-2026-12-05/dev-entities-results.json q-i5/results.json
S="--model $Q --workdir q-i5 --k 8 --questions 2000 --entities 320 --filler 4 --split dev --limit 682 --two-chunk retrieval --wrapper shipped"
sparsecache bench fidelity $S --confident-only --methods "infoflow+ttft_budget=0.5,infoflow+ttft_budget=0.5@wrapped,none@wrapped" \
  --json > q-i5.json
echo "one-chunk, prefix stores rc=$? $(date)"
if [ ! -f qnb-dev/encode.json ]; then
  mkdir -p qnb-dev
  sparsecache encode-corpus q-i5/corpus.jsonl --store qnb-dev/store-wrapped --model $Q --wrapper shipped \
    --encode-after neighbours --json > qnb-dev/encode.json 2> qnb-dev/encode.log
fi
echo "neighbours store encoded $(date)"
mkdir -p qnb-i5
cp q-i5/{corpus.jsonl,questions.json,suite.json} qnb-i5/
[ -d qnb-i5/store ] || cp -r q-i5/store qnb-i5/store
[ -d qnb-i5/store-wrapped ] || cp -r qnb-dev/store-wrapped qnb-i5/store-wrapped
[ -f qnb-i5/results.json ] || python -c "
import json, sys
rows = json.load(open(sys.argv[1]))['rows']
json.dump({'rows': [r for r in rows if r['label'] == 'full']}, open(sys.argv[2], 'w'))
" q-i5/results.json qnb-i5/results.json
S="--model $Q --workdir qnb-i5 --k 8 --questions 2000 --entities 320 --filler 4 --split dev --limit 682 --two-chunk retrieval --wrapper shipped"
sparsecache bench fidelity $S --confident-only --methods "infoflow+ttft_budget=0.5@wrapped,none@wrapped" --json > qnb-i5.json
echo "one-chunk, neighbours store rc=$? $(date)"
python $B/levers-2026-12-07/prepare_model.py q-i5 q-s2c 400 $Q
S="--model $Q --workdir q-s2c --k 8 --questions 2000 --entities 320 --filler 4 --split dev --two-chunk placed --wrapper shipped --limit 400"
sparsecache bench fidelity $S --confident-only --methods "infoflow+ttft_budget=0.5,infoflow+ttft_budget=0.5@wrapped,none@wrapped" \
  --json > q-s2c.json
echo "two-chunk, prefix stores rc=$? $(date)"
mkdir -p qnb-s2c
cp q-s2c/{corpus.jsonl,questions.json,suite.json} qnb-s2c/
[ -d qnb-s2c/store ] || cp -r q-s2c/store qnb-s2c/store
[ -d qnb-s2c/store-wrapped ] || cp -r qnb-dev/store-wrapped qnb-s2c/store-wrapped
[ -f qnb-s2c/results.json ] || python -c "
import json, sys
rows = json.load(open(sys.argv[1]))['rows']
json.dump({'rows': [r for r in rows if r['label'] == 'full']}, open(sys.argv[2], 'w'))
" q-s2c/results.json qnb-s2c/results.json
S="--model $Q --workdir qnb-s2c --k 8 --questions 2000 --entities 320 --filler 4 --split dev --two-chunk placed --wrapper shipped --limit 400"
sparsecache bench fidelity $S --confident-only --methods "infoflow+ttft_budget=0.5@wrapped,none@wrapped" --json > qnb-s2c.json
echo "two-chunk, neighbours store rc=$? $(date)"
