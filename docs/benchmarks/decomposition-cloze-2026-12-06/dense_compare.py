import json
from sparsecache.bench.fidelity import summarise
a=json.load(open('scloze-dev/results.json'))['rows']; b=json.load(open('sdense-cloze/results.json'))['rows']
full={x['question']:x for x in a if x['label']=='full'}
out={}
for lab,src in [('none@wrapped','codes'),('none:0+source=raw@wrapped','exact'),('infoflow:0.1@wrapped','codes'),('infoflow:0.1+source=raw@wrapped','exact'),('infoflow:0.25@wrapped','codes'),('infoflow:0.25+source=raw@wrapped','exact')]:
    rows=[x for x in a if x['label']==lab]; s=summarise(rows, full); out[f'{lab} ({src})']=s
    print(f"{lab:34} {src:6} n {s['questions']} f1 {s.get('answer_f1')} {s.get('answer_f1_ci95')} tok {s.get('token_agreement')} same {s.get('same_answer'):.3f} {s.get('same_answer_ci95')}")
for lab in ('none@wrapped','infoflow:0.1@wrapped','infoflow:0.25@wrapped'):
    rows=[x for x in b if x['label']==lab]
    if not rows: continue
    s=summarise(rows, full); out[f'{lab} (s160)']=s
    print(f"{lab:34} s160   n {s['questions']} f1 {s.get('answer_f1')} {s.get('answer_f1_ci95')} tok {s.get('token_agreement')} same {s.get('same_answer'):.3f} {s.get('same_answer_ci95')}")
    # paired F1 against the s80 codes
    c={x['question']:x for x in a if x['label']==lab}; d={x['question']:x for x in rows}
    qs=[q for q in d if q in c]
    diff=[d[q]['answer_f1']-c[q]['answer_f1'] for q in qs]
    print('   paired F1 s160 - s80:', round(sum(diff)/len(diff),3), 'better', sum(x>0 for x in diff), 'worse', sum(x<0 for x in diff), 'of', len(qs))
json.dump(out, open('dense-cloze-summary.json','w'), indent=1, default=list)
