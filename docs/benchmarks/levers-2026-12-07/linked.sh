#!/bin/bash
# #94 item 3: the learned trailer, linked (recomputed at query time after every chunk before it), SmolLM2-135M.
# The wrapper: sparsecache learn-wrapper --out /work/runs/wrap-linked-h16-t8 --header 16 --trailer 8 --linked \
#   --steps 150 --eval-every 25   (neutral data, the model frozen; the same recipe and length as the shipped neutral one)
# The same one- and two-chunk dev questions as after.sh, answered from the dev corpus encoded with it (plain prefix
# encode: one lever at a time); full prefill's rows reused (its answers do not depend on the store). The baseline is
# the neutral-wrapped store's rows in i5-dev / s2c-dev (run.sh, gates.sh). A linked store's default spends its
# TTFT budget on the trailers first (query/budget.py), so it recomputes no more than the budget buys.
set -e
cd /work/runs
W=/work/runs/wrap-linked-h16-t8
lscpu | grep "Model name"; date
until [ -f $W/wrapper.safetensors ]; do sleep 60; done
for s in i5 s2c; do
  d=lk-$s
  mkdir -p $d
  cp $s-dev/{corpus.jsonl,questions.json,suite.json} $d/
  [ -d $d/store ] || cp -r $s-dev/store $d/store
  [ -f $d/results.json ] || python -c "
import json, sys
rows = json.load(open(sys.argv[1]))['rows']
json.dump({'rows': [r for r in rows if r['label'] == 'full']}, open(sys.argv[2], 'w'))
" $s-dev/results.json $d/results.json
done
M="infoflow+ttft_budget=0.5@wrapped,none@wrapped"
sparsecache bench fidelity --workdir lk-i5 --k 8 --questions 2000 --entities 320 --filler 4 --split dev --limit 682 \
  --wrapper $W --confident-only --methods "$M" --json > lk-i5.json
echo "one-chunk rc=$? $(date)"
[ -d lk-s2c/store-wrapped ] || cp -r lk-i5/store-wrapped lk-s2c/store-wrapped  # one corpus: the same store
sparsecache bench fidelity --workdir lk-s2c --k 8 --questions 2000 --entities 320 --filler 4 --split dev --two-chunk placed \
  --wrapper $W --limit 400 --confident-only --methods "$M" --json > lk-s2c.json
echo "two-chunk rc=$? $(date)"
