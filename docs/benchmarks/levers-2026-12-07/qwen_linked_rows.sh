#!/bin/bash
# #94 items 3 and 5, after qwen_linked.sh: Qwen's linked-trailer store on the same dev questions as its other
# candidates (qwen3.sh: the first 341 one-chunk, the first 200 two-chunk), full prefill's rows reused, then its TTFT
# beside full prefill in one run with the CPU to itself (the first 10 questions, as linked_ttft.sh). The store is
# encoded with the wrapper by the first bench run (plain prefix encode: one lever at a time, as SmolLM2's lk-*).
set -e
cd /work/runs
W=/work/runs/wrap-linked-qwen-t8
Q="--model qwen2.5-coder-0.5b"
lscpu | grep "Model name"; date
[ -f $W/wrapper.safetensors ] || { echo "no wrapper yet: run qwen_linked.sh to the end"; exit 1; }
for s in i5 s2c; do
  d=lk-q-$s
  mkdir -p $d
  cp q-$s/{corpus.jsonl,questions.json,suite.json} $d/
  [ -d $d/store ] || cp -r q-$s/store $d/store
  [ -f $d/results.json ] || python -c "
import json, sys
rows = json.load(open(sys.argv[1]))['rows']
json.dump({'rows': [r for r in rows if r['label'] == 'full']}, open(sys.argv[2], 'w'))
" q-$s/results.json $d/results.json
done
S="$Q --k 8 --questions 2000 --entities 320 --filler 4 --split dev --wrapper $W --confident-only"
M="infoflow+ttft_budget=0.5@wrapped"
sparsecache bench fidelity $S --workdir lk-q-i5 --limit 341 --two-chunk retrieval --methods "$M" --json > lk-q-i5.json
echo "one-chunk rc=$? $(date)"
[ -d lk-q-s2c/store-wrapped ] || cp -r lk-q-i5/store-wrapped lk-q-s2c/store-wrapped  # one corpus: the same store
sparsecache bench fidelity $S --workdir lk-q-s2c --limit 200 --two-chunk placed --methods "$M" --json > lk-q-s2c.json
echo "two-chunk rc=$? $(date)"
P="+prefill_under=0"
sparsecache bench fidelity $Q --workdir lk-q-i5 --k 8 --questions 2000 --entities 320 --filler 4 --split dev --limit 10 \
  --two-chunk retrieval --wrapper $W --methods "full+first_layer=tokens$P,$M$P" --json > lk-q-ttft.json
echo "timed rc=$? $(date)"; uptime
