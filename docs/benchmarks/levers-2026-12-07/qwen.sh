#!/bin/bash
# #94 item 5: Qwen2.5-Coder-0.5B beside SmolLM2 on the candidates, on the same dev questions (format (a), k = 8):
# one-chunk: the first 682 questions of #69's dev suite, contexts as retrieval returns them (q-i5; full prefill's rows
# reused from #80's run on the first 940 of the same suite, docs/benchmarks/qwen80-2026-12-05); two-chunk: the first
# 400 two-chunk questions placed (qwen2.sh). Here: Qwen's plain store (its default) and its neutral-wrapped store,
# the default on each; every candidate row on full prefill's confident questions; one job at a time, torch's
# default threads (2 cores).
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
# Stopped (2026-12-07 14:10) in the command above's last label, none@wrapped: the default came out worse from Qwen's wrapped
# store than from its plain one, so the neighbours store is built plain and the rest runs from qwen2.sh.
