"""The figures of gates2.sh, after.sh and ttft2.sh: kept per split and pooled (Wilson 95%) of each label on each
store, and the quiet TTFT of ttft2.sh's run (all 10 questions timed in it, every label beside full prefill).
Usage: python summarise2.py RUNS OUT.json   (RUNS: the directory holding i5-dev, s2c-dev, nb-i5, nb-s2c and the
ttft2 JSON files)"""
import json
import sys
from pathlib import Path

from sparsecache.measure.stats import wilson

runs, out = Path(sys.argv[1]), sys.argv[2]
P = "+prefill_under=0"
CANDIDATES = [  # (name, store, label in the fidelity runs, label in ttft2.sh's run, ttft2 JSON)
    ("default", "prefix", "infoflow+ttft_budget=0.5+first_layer=tokens@wrapped", f"infoflow+ttft_budget=0.5{P}@wrapped",
     "i5-ttft2.json"),
    ("default + gate_coverage 0.8, budget 0.4", "prefix", "infoflow+ttft_budget=0.4+gate_coverage=0.8@wrapped",
     f"infoflow+ttft_budget=0.4+gate_coverage=0.8{P}@wrapped", "i5-ttft2.json"),
    ("default + gate_coverage 0.8, budget 0.35", "prefix", "infoflow+ttft_budget=0.35+gate_coverage=0.8@wrapped",
     f"infoflow+ttft_budget=0.35+gate_coverage=0.8{P}@wrapped", "i5-ttft2.json"),
    ("none", "neighbours", "none@wrapped", None, None),
    ("default", "neighbours", "infoflow+ttft_budget=0.5@wrapped", f"infoflow+ttft_budget=0.5{P}@wrapped", "nb-ttft2.json"),
    ("default + gate_coverage 0.8, budget 0.4", "neighbours", "infoflow+ttft_budget=0.4+gate_coverage=0.8@wrapped",
     None, None),
]
DIRS = {"prefix": ("i5-dev", "s2c-dev"), "neighbours": ("nb-i5", "nb-s2c")}


def rows(work):
    r = json.load(open(runs / work / "results.json"))["rows"]
    return r, {x["question"]: x for x in r if x["label"] == "full"}


def kept(work, label):
    r, full = rows(work)
    sure = [x for x in r if x["label"] == label and full[x["question"]].get("confident")]
    return sum(bool(x["correct"]) for x in sure), len(sure), sure


result = []
for name, store, label, tlabel, tfile in CANDIDATES:
    e = {"candidate": name, "store": store, "label": label}
    for split, work in zip(("one_chunk", "two_chunk"), DIRS[store]):
        k, n, sure = kept(work, label)
        if n:
            e[split] = {"kept": k, "confident": n, "share": round(k / n, 4), "ci95": wilson(k, n),
                        "same_answer": round(sum(x["same_answer"] for x in sure) / n, 4),
                        "value_agreement": round(sum(x.get("value_agreement", 0) for x in sure) / n, 4),
                        "recomputed_tokens": round(sum(x["recomputed_tokens"] for x in sure) / n, 1)}
    if "one_chunk" in e and "two_chunk" in e:
        k = e["one_chunk"]["kept"] + e["two_chunk"]["kept"]
        n = e["one_chunk"]["confident"] + e["two_chunk"]["confident"]
        e["pooled"] = {"kept": k, "confident": n, "share": round(k / n, 4), "ci95": wilson(k, n)}
    if tlabel:
        work = "i5-dev" if store == "prefix" else "nb-i5"
        r, _ = rows(work)
        first = [f"k8-{i:03d}" for i in range(10)]
        t = [x["ttft_ms"] for x in r if x["label"] == tlabel and x["question"] in first]
        f = [x["ttft_ms"] for x in r if x["label"] == f"full+first_layer=tokens{P}" and x["question"] in first]
        if len(t) == len(f) == 10:
            e["ttft_quiet"] = {"mean_ms": round(sum(t) / 10, 1), "p90_ms": sorted(t)[8],
                               "full_mean_ms": round(sum(f) / 10, 1), "x_full": round(sum(t) / sum(f), 3)}
    result.append(e)
json.dump(result, open(out, "w"), indent=1)
for e in result:
    parts = [f"{s} {e[s]['kept']}/{e[s]['confident']} {e[s]['ci95']}" for s in ("one_chunk", "two_chunk", "pooled")
             if s in e]
    print(f"{e['store']:10s} {e['candidate']:42s} {'; '.join(parts)}  {e.get('ttft_quiet')}")
