#!/bin/bash
# #94 item 2 (form b): the same dev questions as run.sh and gates.sh, answered from a copy of the neutral-wrapped
# store encoded with --encode-after neighbours (every chunk's K/V computed after its nearest chunk of another
# document); both suites share one corpus, so one store serves them. Full prefill's rows are reused (its answers
# do not depend on the store); every method row is computed again from the new store.
set -e
cd /work/runs
lscpu | grep "Model name"; date
if [ ! -f nb-dev/encode.json ]; then
  mkdir -p nb-dev
  /usr/bin/time -v sparsecache encode-corpus i5-dev/corpus.jsonl --store nb-dev/store-wrapped --wrapper shipped \
    --encode-after neighbours --json > nb-dev/encode.json 2> nb-dev/encode.log
fi
for s in i5 s2c; do
  d=nb-$s
  mkdir -p $d
  cp $s-dev/{corpus.jsonl,questions.json,suite.json} $d/
  [ -d $d/store ] || cp -r $s-dev/store $d/store
  [ -d $d/store-wrapped ] || cp -r nb-dev/store-wrapped $d/store-wrapped
  [ -f $d/results.json ] || python -c "
import json, sys
rows = json.load(open(sys.argv[1]))['rows']
json.dump({'rows': [r for r in rows if r['label'] == 'full']}, open(sys.argv[2], 'w'))
" $s-dev/results.json $d/results.json
done
M="none@wrapped,infoflow+ttft_budget=0.5@wrapped,infoflow+ttft_budget=0.4+gate_coverage=0.8@wrapped"
sparsecache bench fidelity --workdir nb-i5 --k 8 --questions 2000 --entities 320 --filler 4 --split dev --limit 682 \
  --wrapper shipped --confident-only --methods "$M" --json > nb-i5.json
echo "one-chunk rc=$? $(date)"
sparsecache bench fidelity --workdir nb-s2c --k 8 --questions 2000 --entities 320 --filler 4 --split dev --two-chunk placed \
  --wrapper shipped --limit 400 --confident-only --methods "$M" --json > nb-s2c.json
echo "two-chunk rc=$? $(date)"
