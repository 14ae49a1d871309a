#!/bin/bash
# #94 items 1 and 3 (SmolLM2, format (a) dev, k = 8, the neutral-wrapped store): chunkflow and legolink beside the
# default at the same TTFT budget, on #69's dev suite (one-chunk questions: full prefill confident on 54 of 682) and on
# its 400 two-chunk questions with both chunks placed (confident on 27). Full prefill's rows and the former candidates'
# are reused from docs/benchmarks (fidelity69-2026-11-29, budget-2026-12-06, twochunk-2026-12-06); the default runs
# again under a second label (first_layer=tokens is its default) so that its rows come from the rebuilt stores too.
set -e
B=/work/main/docs/benchmarks
cd /work/runs
lscpu | grep "Model name"; date
mkdir -p i5-dev
cp $B/fidelity69-2026-11-29/dev-entities/{corpus.jsonl,questions.json,suite.json} i5-dev/
[ -f i5-dev/results.json ] || python $B/levers-2026-12-07/merge_rows.py i5-dev/results.json \
  $B/fidelity69-2026-11-29/dev-entities/results.json $B/budget-2026-12-06/dev-all-682-rows.json $B/budget-2026-12-06/dev-new-rows.json
M="infoflow+ttft_budget=0.5+first_layer=tokens@wrapped,chunkflow+ttft_budget=0.5@wrapped,legolink+ttft_budget=0.5@wrapped,legolink:1@wrapped"
S="--workdir i5-dev --k 8 --questions 2000 --entities 320 --filler 4 --split dev --limit 682 --wrapper shipped"
sparsecache bench fidelity $S --confident-only --methods "$M" --json > i5-dev-levers.json   # encodes both stores first
echo "one-chunk rc=$? $(date)"
python $B/twochunk-2026-12-06/prepare.py 400   # s2c-dev: the two-chunk questions placed, i5-dev's stores
# the recorded rows were kept without full prefill's value-token distributions (value_support): full prefill runs
# again on its confident questions, so every method's value-token figures have their reference
[ -f s2c-dev/results.json ] || python -c "
import json, sys
rows = json.load(open(sys.argv[1]))['rows']
json.dump({'rows': [r for r in rows if not (r['label'] == 'full' and r['confident'])]}, open(sys.argv[2], 'w'))
" $B/twochunk-2026-12-06/smollm2-dev-placed-results.json s2c-dev/results.json
S2="--workdir s2c-dev --k 8 --questions 2000 --entities 320 --filler 4 --split dev --two-chunk placed --wrapper shipped --limit 400"
sparsecache bench fidelity $S2 --confident-only --methods "$M" --json > s2c-dev-levers.json
echo "two-chunk rc=$? $(date)"
