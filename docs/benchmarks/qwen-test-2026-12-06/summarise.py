"""Summaries of a fidelity workdir's rows by label, over all questions and split by hops (one- and
two-chunk), with full prefill's rows as the reference; optional JSON out."""
import json, sys
from collections import defaultdict
from sparsecache.bench.fidelity import summarise
rows = json.load(open(sys.argv[1]))['rows']
full = {r['question']: r for r in rows if r['label'] == 'full'}
out = {}
for hops in (None, 1, 2):
    sel = [r for r in rows if hops is None or r['hops'] == hops]
    fs = [r for r in sel if r['label'] == 'full']
    if not fs:
        continue
    tag = 'all' if hops is None else f'hops={hops}'
    print(f'== {tag}: full {len(fs)} right {sum(bool(r["correct"]) for r in fs)} confident '
          f'{sum(bool(r.get("confident")) for r in fs)} ttft {sum(r["ttft_ms"] for r in fs)/len(fs):.0f} ms '
          f'tokens {sum(r["context_tokens"] for r in fs)/len(fs):.0f} holds {sum(bool(r.get("holds_answer")) for r in fs)}')
    by = defaultdict(list)
    for r in sel:
        if r['label'] != 'full':
            by[r['label']].append(r)
    out[tag] = {'full': {'questions': len(fs), 'right': sum(bool(r['correct']) for r in fs),
                         'confident': sum(bool(r.get('confident')) for r in fs),
                         'ttft_ms': sum(r['ttft_ms'] for r in fs) / len(fs)}}
    for label, rs in by.items():
        s = summarise(rs, full)
        rr = [r['recomputed_tokens'] / r['context_tokens'] for r in rs if r.get('recomputed_tokens')]
        if rr:
            s['mean_recompute_ratio'] = sum(rr) / len(rr)
        out[tag][label] = s
        print(f"  {label:30} n {s['questions']:4} kept {s.get('kept')} {s.get('kept_ci95')} of {s.get('confident')}  "
              f"same {s.get('same_answer', 0):.3f} {s.get('same_answer_ci95')}  f1 {s.get('answer_f1')}  "
              f"top1 {s.get('value_top1', s.get('value_agreement'))}  kl {s.get('value_kl')}  ttft {s['ttft_ms']}"
              + (f"  r {s['mean_recompute_ratio']:.3f}" if rr else ''))
if len(sys.argv) > 2:
    json.dump(out, open(sys.argv[2], 'w'), indent=1, default=list)
