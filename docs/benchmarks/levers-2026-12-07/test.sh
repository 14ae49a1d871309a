#!/bin/bash
# #94 item 6/7: the chosen configuration on the test splits, read once after #69's rule chose it on dev.
# Chosen (dev, both models, one- and two-chunk pooled; BENCHMARKS.md): each chunk encoded after its nearest neighbour
# (encode-corpus --encode-after neighbours), queried with the default (infoflow, --ttft-budget 0.5). Each model's own
# default store otherwise: SmolLM2 neutral-wrapped, Qwen plain.
# The splits: format (a) test (1000 questions, 160 entities, filler 4, k = 8), the suite #69/#79 read:
#   one-chunk: the first $ONE (SmolLM2) / 240 (Qwen) questions, retrieval contexts; full prefill's rows reused where they
#     exist (#69's for SmolLM2; #80's for Qwen's one-hop questions: its two-hop ones were placed, so answered again);
#   two-chunk: every two-hop question of the 1000 (200) for SmolLM2, the first 100 for Qwen (as on dev, where Qwen
#     answered the first 200 of 400: its full prefill takes ~3x SmolLM2's), both needed chunks placed among
#     retrieval's look-alikes (as dev's 400).
# Usage: bash test.sh smollm2|qwen   (one model per job; the two can run side by side on 2 cores)
set -e
cd /work/runs
B=/work/main/docs/benchmarks
L=$B/levers-2026-12-07
T=$B/fidelity69-2026-11-29/test-entities
ONE=${ONE:-400}
M="infoflow+ttft_budget=0.5"
lscpu | grep "Model name"; date
keep_full() {  # $1: rows file, $2: out, $3: hops to keep (1 or "1,2"), $4: first N question ids
  python -c "
import json, sys
rows = json.load(open(sys.argv[1]))['rows']
hops, n = {int(h) for h in sys.argv[3].split(',')}, int(sys.argv[4])
keep = [r for r in rows if r['label'] == 'full' and r['hops'] in hops and int(r['question'].split('-')[1]) < n]
json.dump({'rows': keep}, open(sys.argv[2], 'w'))
print(len(keep), 'full rows reused')
" "$@"
}
if [ "$1" = smollm2 ]; then
  d=t94-s1
  mkdir -p $d
  cp $T/{corpus.jsonl,questions.json,suite.json} $d/
  [ -f $d/results.json ] || keep_full $T/results.json $d/results.json 1,2 $ONE
  [ -f $d/encode.json ] || sparsecache encode-corpus $d/corpus.jsonl --store $d/store-wrapped --wrapper shipped \
    --encode-after neighbours --json > $d/encode.json 2> $d/encode.log
  S="--k 8 --questions 1000 --entities 160 --filler 4 --split test --wrapper shipped"
  sparsecache bench fidelity --workdir $d $S --limit $ONE --confident-only --methods "$M@wrapped" --json > $d.json
  echo "one-chunk rc=$? $(date)"
  python $L/prepare_model.py $d t94-s2 1000 default
  sparsecache bench fidelity --workdir t94-s2 $S --two-chunk placed --limit 1000 --confident-only --methods "$M@wrapped" \
    --json > t94-s2.json
  echo "two-chunk rc=$? $(date)"
elif [ "$1" = qwen ]; then
  Q="--model qwen2.5-coder-0.5b"
  d=t94-q1
  mkdir -p $d
  cp $T/{corpus.jsonl,questions.json} $d/
  python -c "import json; s = json.load(open('$T/suite.json')); s['model'] = 'qwen2.5-coder-0.5b'; json.dump(s, open('$d/suite.json', 'w'))"
  [ -f $d/results.json ] || keep_full $B/qwen-test-2026-12-06/test-entities-results.json $d/results.json 1 240
  [ -f $d/encode.json ] || sparsecache encode-corpus $d/corpus.jsonl --store $d/store $Q --wrapper none \
    --encode-after neighbours --json > $d/encode.json 2> $d/encode.log
  S="$Q --k 8 --questions 1000 --entities 160 --filler 4 --split test"
  sparsecache bench fidelity --workdir $d $S --limit 240 --confident-only --methods "$M" --json > $d.json
  echo "one-chunk rc=$? $(date)"
  python $L/prepare_model.py $d t94-q2 ${QTWO:-100} qwen2.5-coder-0.5b  # the first half of the 200 two-hop ones, as on dev
  sparsecache bench fidelity --workdir t94-q2 $S --two-chunk placed --limit 1000 --confident-only --methods "$M" \
    --json > t94-q2.json
  echo "two-chunk rc=$? $(date)"
fi
