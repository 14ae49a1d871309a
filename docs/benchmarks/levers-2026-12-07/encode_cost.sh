#!/bin/bash
# #94 item 2: what encoding after neighbours costs, beside a plain encode of the same documents in the same run, the
# CPU to itself: the first 64 documents of the dev corpus (one chunk each, ~140 tokens), the neutral wrapper, both
# ways twice in alternation (the second round is reported; the first warms the caches): after nothing, after the
# nearest neighbour, after the two nearest.
cd /work/runs
lscpu | grep "Model name"; date; uptime
head -n 64 i5-dev/corpus.jsonl > cost-corpus.jsonl
for round in 1 2; do
  for way in prefix:1 neighbours:1 neighbours:2; do
    mode=${way%:*}; n=${way#*:}
    rm -rf cost-$mode-$n
    sparsecache encode-corpus cost-corpus.jsonl --store cost-$mode-$n --wrapper shipped --encode-after $mode \
      --encode-after-chunks $n --json > cost-$mode-$n-$round.json
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r['seconds'])" cost-$mode-$n-$round.json $way
  done
done
date; uptime
