"""#94 item 5: the figures of qwen.sh (Qwen2.5-Coder-0.5B, format (a) dev, k = 8) beside SmolLM2's on the same
candidates (after.sh, gates.sh): per candidate and split, kept (Wilson 95%), the same answer as full prefill, token
F1 against full prefill's answer and value-token top-1 agreement (seeded bootstrap 95%), on full prefill's confident
questions, and one-chunk and two-chunk pooled.
Usage: python summarise_qwen.py RUNS OUT.json   (RUNS: the directory holding the workdirs below)"""
import json
import math
import sys
from pathlib import Path

from sparsecache.measure.answers import answer_span, token_f1
from sparsecache.measure.stats import bootstrap, mean, wilson

runs, out = Path(sys.argv[1]), sys.argv[2]
CANDIDATES = [  # (model, store, label, one-chunk workdir, two-chunk workdir); Qwen's default store is plain
    ("qwen2.5-coder-0.5b", "plain", "none", "q-i5", "q-s2c"),
    ("qwen2.5-coder-0.5b", "plain", "infoflow+ttft_budget=0.5", "q-i5", "q-s2c"),
    ("qwen2.5-coder-0.5b", "wrapped", "none@wrapped", "q-i5", "q-s2c"),
    ("qwen2.5-coder-0.5b", "wrapped", "infoflow+ttft_budget=0.5@wrapped", "q-i5", "q-s2c"),
    ("qwen2.5-coder-0.5b", "plain, after 1 neighbour", "none", "qnb-i5", "qnb-s2c"),
    ("qwen2.5-coder-0.5b", "plain, after 1 neighbour", "infoflow+ttft_budget=0.5", "qnb-i5", "qnb-s2c"),
    # SmolLM2's default store is the neutral-wrapped one; its prefix-store rows are #79's (i5-dev, s2c-dev)
    ("smollm2-135m", "wrapped", "none@wrapped", "i5-dev", "s2c-dev"),
    ("smollm2-135m", "wrapped", "infoflow+ttft_budget=0.5+first_layer=tokens@wrapped", "i5-dev", "s2c-dev"),
    ("smollm2-135m", "wrapped, after 1 neighbour", "none@wrapped", "nb-i5", "nb-s2c"),
    ("smollm2-135m", "wrapped, after 1 neighbour", "infoflow+ttft_budget=0.5@wrapped", "nb-i5", "nb-s2c"),
    # item 3: the linked trailer (linked.sh; the prefix layout, wrapper h16 + linked t8)
    ("smollm2-135m", "linked-wrapped", "none@wrapped", "lk-i5", "lk-s2c"),
    ("smollm2-135m", "linked-wrapped", "infoflow+ttft_budget=0.5@wrapped", "lk-i5", "lk-s2c"),
    # Qwen's levers on its plain store (qwen3.sh; the first 341 one-chunk questions: see rule.py for the paired view)
    ("qwen2.5-coder-0.5b", "plain", "chunkflow+ttft_budget=0.5", "q-i5", "q-s2c"),
    ("qwen2.5-coder-0.5b", "plain", "legolink+ttft_budget=0.5", "q-i5", "q-s2c"),
    ("qwen2.5-coder-0.5b", "plain", "infoflow+ttft_budget=0.4+gate_coverage=0.8", "q-i5", "q-s2c"),
]


def split(work, label):
    path = runs / work / "results.json"
    if not path.exists():
        return None
    rows = json.load(open(path))["rows"]
    full = {x["question"]: x for x in rows if x["label"] == "full"}
    sure = [x for x in rows if x["label"] == label and full[x["question"]].get("confident")]
    for x in sure:  # against full prefill's answer (rows from before #79 item 5 lack the F1)
        ref = answer_span(full[x["question"]]["answer"])
        x["same_answer"], x["answer_f1"] = answer_span(x["answer"]) == ref, token_f1(answer_span(x["answer"]), ref)
    return sure, sum(1 for x in full.values() if x.get("confident")), len(full)


def figures(sure):
    k = sum(bool(x["correct"]) for x in sure)
    n = len(sure)
    return {"kept": k, "confident": n, "share": round(k / n, 4), "ci95": wilson(k, n),
            "same_answer": round(mean([x["same_answer"] for x in sure]), 4),
            "same_answer_ci95": bootstrap(sure, lambda s: mean([x["same_answer"] for x in s])),
            "answer_f1": round(mean([x["answer_f1"] for x in sure]), 4),
            "answer_f1_ci95": bootstrap(sure, lambda s: mean([x["answer_f1"] for x in s])),
            "value_agreement": round(mean([x.get("value_agreement", 0) for x in sure]), 4),
            "value_agreement_ci95": bootstrap(sure, lambda s: mean([x.get("value_agreement", 0) for x in s])),
            "recomputed_tokens": round(mean([x["recomputed_tokens"] for x in sure]), 1)}


result = []
for model, store, label, one, two in CANDIDATES:
    e = {"model": model, "store": store, "label": label}
    parts = []
    for name, work in (("one_chunk", one), ("two_chunk", two)):
        got = split(work, label)
        if got is None:
            continue
        sure, confident, questions = got
        e[f"{name}_questions"] = {"questions": questions, "confident": confident}
        if sure and len(sure) == confident:  # every confident question answered (a run still going is left out)
            e[name] = figures(sure)
            parts.append(sure)
        elif sure:
            e[name + "_partial"] = {"answered": len(sure), "of": confident}
    if len(parts) == 2:
        e["pooled"] = figures(parts[0] + parts[1])
    result.append(e)
def sign_test(gained: int, lost: int) -> float:
    """Two-sided exact sign test of gained against lost answers (ties left out)."""
    n, k = gained + lost, min(gained, lost)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0


PAIRS = [(1, 3), (1, 5), (0, 4), (7, 9), (6, 8), (7, 11), (6, 10)]  # (before, after) indices of CANDIDATES, one model
for a, b in PAIRS:
    before, after = result[a], result[b]
    pair = {"before": [before["store"], before["label"]], "after": [after["store"], after["label"]],
            "model": before["model"]}
    gained = lost = 0
    for name, works in (("one_chunk", (CANDIDATES[a][3], CANDIDATES[b][3])), ("two_chunk", (CANDIDATES[a][4], CANDIDATES[b][4]))):
        x, y = split(works[0], CANDIDATES[a][2]), split(works[1], CANDIDATES[b][2])
        if not x or not y or name not in before or name not in after:
            continue
        bx = {r["question"]: bool(r["correct"]) for r in x[0]}
        by = {r["question"]: bool(r["correct"]) for r in y[0]}
        g = sum(by[q] and not bx[q] for q in bx if q in by)
        lo = sum(bx[q] and not by[q] for q in bx if q in by)
        pair[name] = {"gained": g, "lost": lo}
        gained, lost = gained + g, lost + lo
    pair["pooled"] = {"gained": gained, "lost": lost, "sign_test_p": round(sign_test(gained, lost), 3)}
    result.append({"paired": pair})
json.dump(result, open(out, "w"), indent=1)
for e in result:
    if "paired" in e:
        print("paired", json.dumps(e["paired"]))
        continue
    cells = [f"{s} {e[s]['kept']}/{e[s]['confident']} {e[s]['ci95']} same {e[s]['same_answer']:.2f} "
             f"F1 {e[s]['answer_f1']:.2f}" for s in ("one_chunk", "two_chunk", "pooled") if s in e]
    cells += [f"{s}: {e[s]['answered']}/{e[s]['of']} so far" for s in ("one_chunk_partial", "two_chunk_partial") if s in e]
    print(f"{e['model']:19s} {e['store']:27s} {e['label']:52s} " + "; ".join(cells))
