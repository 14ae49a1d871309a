#!/bin/bash
# #94 item 2, the next point: each chunk encoded after its TWO nearest chunks of other documents (the nearest next to
# it), the same questions and labels as after.sh.
set -e
cd /work/runs
lscpu | grep "Model name"; date
if [ ! -f nb2-dev/encode.json ]; then
  mkdir -p nb2-dev
  sparsecache encode-corpus i5-dev/corpus.jsonl --store nb2-dev/store-wrapped --wrapper shipped \
    --encode-after neighbours --encode-after-chunks 2 --json > nb2-dev/encode.json 2> nb2-dev/encode.log
fi
echo "encoded $(date)"
for s in i5 s2c; do
  d=nb2-$s
  mkdir -p $d
  cp $s-dev/{corpus.jsonl,questions.json,suite.json} $d/
  [ -d $d/store ] || cp -r $s-dev/store $d/store
  [ -d $d/store-wrapped ] || cp -r nb2-dev/store-wrapped $d/store-wrapped
  [ -f $d/results.json ] || python -c "
import json, sys
rows = json.load(open(sys.argv[1]))['rows']
json.dump({'rows': [r for r in rows if r['label'] == 'full']}, open(sys.argv[2], 'w'))
" $s-dev/results.json $d/results.json
done
M="none@wrapped,infoflow+ttft_budget=0.5@wrapped"
sparsecache bench fidelity --workdir nb2-i5 --k 8 --questions 2000 --entities 320 --filler 4 --split dev --limit 682 \
  --wrapper shipped --confident-only --methods "$M" --json > nb2-i5.json
echo "one-chunk rc=$? $(date)"
sparsecache bench fidelity --workdir nb2-s2c --k 8 --questions 2000 --entities 320 --filler 4 --split dev --two-chunk placed \
  --wrapper shipped --limit 400 --confident-only --methods "$M" --json > nb2-s2c.json
echo "two-chunk rc=$? $(date)"
