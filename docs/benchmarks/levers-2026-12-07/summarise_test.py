"""#94 item 7: the test splits, read once after the rule's choice (test.sh): for each model, the chosen configuration
on full prefill's confident questions, one-chunk (one-hop questions, retrieval's contexts) and two-chunk (two-hop
questions, both chunks placed) apart and pooled: kept, the same answer, token F1 and value-token agreement, with
Wilson/bootstrap intervals, and TTFT beside full prefill's (mean and p90) over the same questions.
Usage: python summarise_test.py RUNS OUT.json"""
import json
import sys
from pathlib import Path

from sparsecache.measure.stats import bootstrap, mean, wilson

runs, out = Path(sys.argv[1]), sys.argv[2]
LABEL = "infoflow+ttft_budget=0.5"
SETS = {"smollm2-135m": ("t94-s1", "t94-s2", LABEL + "@wrapped"), "qwen2.5-coder-0.5b": ("t94-q1", "t94-q2", LABEL)}


def boot(xs):
    return list(bootstrap(xs, mean))


def p90(xs):  # nearest rank, as bench fidelity's summary
    xs = sorted(xs)
    return xs[-(-9 * len(xs) // 10) - 1]


def rows(work, label, hops):
    path = runs / work / "results.json"
    if not path.exists():
        return None
    r = json.load(open(path))["rows"]
    full = {x["question"]: x for x in r if x["label"] == "full" and x["hops"] == hops}
    ours = {x["question"]: x for x in r if x["label"] == label and x["question"] in full}
    sure = [q for q, x in full.items() if x.get("confident")]
    if not sure or any(q not in ours for q in sure):  # not answered yet
        return None
    return [(full[q], ours[q]) for q in sure], len(full)


result = {}
for model, (one, two, label) in SETS.items():
    e = result[model] = {"label": label}
    pooled = []
    for split, work, hops in (("one_chunk", one, 1), ("two_chunk", two, 2)):
        got = rows(work, label, hops)
        if got is None:
            continue
        pairs, answered = got
        pooled += pairs
        k = sum(bool(o["correct"]) for _, o in pairs)
        tf, to = [f["ttft_ms"] for f, _ in pairs], [o["ttft_ms"] for _, o in pairs]
        e[split] = {"questions": answered, "confident": len(pairs), "kept": k, "kept_share": round(k / len(pairs), 4),
                    "kept_ci95": wilson(k, len(pairs)),
                    "same_answer": round(sum(bool(o["same_answer"]) for _, o in pairs) / len(pairs), 4),
                    "same_answer_ci95": wilson(sum(bool(o["same_answer"]) for _, o in pairs), len(pairs)),
                    "answer_f1": round(sum(o["answer_f1"] for _, o in pairs) / len(pairs), 4),
                    "answer_f1_ci95": boot([o["answer_f1"] for _, o in pairs]),
                    "value_agreement": round(sum(o["value_agreement"] for _, o in pairs) / len(pairs), 4),
                    "value_agreement_ci95": boot([o["value_agreement"] for _, o in pairs]),
                    "ttft_mean_ms": round(sum(to) / len(to), 1), "ttft_p90_ms": round(p90(to), 1),
                    "full_ttft_mean_ms": round(sum(tf) / len(tf), 1), "full_ttft_p90_ms": round(p90(tf), 1),
                    "x_full_mean": round(sum(to) / sum(tf), 3)}
    if pooled:
        k = sum(bool(o["correct"]) for _, o in pooled)
        e["pooled"] = {"confident": len(pooled), "kept": k, "kept_share": round(k / len(pooled), 4),
                       "kept_ci95": wilson(k, len(pooled)),
                       "same_answer": round(sum(bool(o["same_answer"]) for _, o in pooled) / len(pooled), 4),
                       "same_answer_ci95": wilson(sum(bool(o["same_answer"]) for _, o in pooled), len(pooled))}
json.dump(result, open(out, "w"), indent=1)
print(json.dumps(result, indent=1))
