"""#94, after the test read: the one-chunk test questions whose answer changed between the former default stores
and the neighbours store (+5/-8), one by one: where the needed chunk sat in the context, which document it was
encoded after (the store's `after` column), whether that document was also retrieved, whether it is a look-alike of
the same template, and which corpus documents hold the values each store answered with.
Usage: python changed.py RUNS OUT.json   (RUNS: the directory holding t94-s1 and t94-q1; test-rows.json beside this)"""
import json
import re
import sys
from pathlib import Path

from sparsecache.store import Store

runs, out = Path(sys.argv[1]), sys.argv[2]
here = Path(__file__).parent
rows = json.load(open(here / "test-rows.json"))["rows"]
B = here.parent
# workdir: (model, the neighbours store, its label in test-rows.json, the former default's rows and label)
WORK = {"t94-s1": ("smollm2-135m", "store-wrapped", "infoflow+ttft_budget=0.5@wrapped",
                   B / "budget-2026-12-06/test/entities-default-rows.json", "infoflow+ttft_budget=0.5@wrapped"),
        "t94-q1": ("qwen2.5-coder-0.5b", "store", "infoflow+ttft_budget=0.5",
                   B / "qwen-test-2026-12-06/test-entities-results.json", "infoflow+ttft_budget=0.5")}


def words(text):
    return set(re.findall(r"[A-Z][a-z]+|\d{2,4}", text))


result = []
for work, (model, store_dir, label, former, former_label) in WORK.items():
    store = Store.open(runs / work / store_dir)
    chunk_doc = dict(zip(store.column("chunk_id"), store.column("doc_id")))
    after = dict(zip(store.column("chunk_id"), store.column("after")))
    corpus = {d["id"]: d["text"] for d in map(json.loads, open(runs / work / "corpus.jsonl"))}
    questions = {q["id"]: q for q in json.load(open(runs / work / "questions.json"))["8"]}
    mine = [r for r in rows if r["workdir"] == work]
    full = {r["question"]: r for r in mine if r["label"] == "full"}
    new = {r["question"]: r for r in mine if r["label"] == label}
    old = {r["question"]: r for r in json.load(open(former))["rows"] if r["label"] == former_label and r["question"] in full}
    for qid in sorted(set(new) & set(old)):
        if full[qid]["hops"] != 1 or not full[qid]["confident"] or new[qid]["correct"] == old[qid]["correct"]:
            continue
        q = questions[qid]
        need = q["needed"][0]
        read = [c for c in str(after[need]).split(",") if c]
        read_docs = [chunk_doc.get(c, c) for c in read]
        own = q["docs"][0]
        entry = {"model": model, "question": qid, "text": q["question"], "truth": q["truth"],
                 "change": "gained" if new[qid]["correct"] else "lost",
                 "needed_position": q["chunks"].index(need) + 1, "needed_doc": own,
                 "encoded_after": read_docs,
                 "after_same_template": [d.split("-")[0] == own.split("-")[0] for d in read_docs],
                 "after_retrieved": [c in q["chunks"] for c in read],
                 "answers": {"full": full[qid]["answer"], "former": old[qid]["answer"], "neighbours": new[qid]["answer"]}}
        for which in ("former", "neighbours"):
            extra = words(entry["answers"][which]) - words(q["question"]) - {"The", "In", "It"}
            foreign = extra - words(corpus[own])  # words of the answer that the needed document does not hold
            if foreign:
                holders = sorted(d for d, t in corpus.items() if foreign <= words(t))[:5]
                entry[f"{which}_foreign_words"] = sorted(foreign)
                entry[f"{which}_found_in"] = holders
                entry[f"{which}_found_in_context"] = sorted({chunk_doc[c] for c in q["chunks"]} & set(holders))
        result.append(entry)
json.dump(result, open(out, "w"), indent=1)
for e in result:
    print(f"{e['model'][:7]} {e['question']} {e['change']:6s} pos {e['needed_position']} doc {e['needed_doc']:12s} "
          f"after {e['encoded_after']} same-template {e['after_same_template']} retrieved {e['after_retrieved']}")
    for which in ("former", "neighbours"):
        if f"{which}_found_in" in e:
            print(f"    {which}: {e[f'{which}_foreign_words']} in {e[f'{which}_found_in']} "
                  f"(in context: {e[f'{which}_found_in_context']})")
    print("    full:", e["answers"]["full"][:90], "| former:", e["answers"]["former"][:90], "| neighbours:",
          e["answers"]["neighbours"][:90])
