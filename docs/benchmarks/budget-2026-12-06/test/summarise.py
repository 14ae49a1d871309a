"""Summaries of a fidelity workdir's rows: every label over the questions it answered (full prefill's rows as reference)."""
import json, sys
from collections import defaultdict
from sparsecache.bench.fidelity import summarise
rows = json.load(open(sys.argv[1]))['rows']
full = {r['question']: r for r in rows if r['label'] == 'full'}
by = defaultdict(list)
for r in rows:
    if r['label'] != 'full':
        by[r['label']].append(r)
out = {}
for label, rs in by.items():
    s = summarise(rs, full)
    out[label] = s
    print(f"{label:38} n {s['questions']:4} kept {s.get('kept')} {s.get('kept_ci95')} of {s.get('confident')}  same {s.get('same_answer', 0):.3f} {s.get('same_answer_ci95')}  f1 {s.get('answer_f1')}  top1 {s.get('value_top1', s.get('value_agreement'))}  ttft {s['ttft_ms']}")
fs = list(full.values())
print('full', len(fs), 'right', sum(bool(r['correct']) for r in fs), 'confident', sum(bool(r.get('confident')) for r in fs))
if len(sys.argv) > 2:
    json.dump(out, open(sys.argv[2], 'w'), indent=1, default=list)
