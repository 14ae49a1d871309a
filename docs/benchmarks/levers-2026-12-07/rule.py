"""#94 item 6: #69's rule over every #94 candidate, on dev, one- and two-chunk questions pooled, for each model
and for both together: among the configurations whose quiet mean TTFT is within the budget (0.5x full prefill's,
measured beside it in one run), the one with the highest Wilson 95% lower bound of *kept* (full prefill's
confident right answers still right). A candidate is a store (how its chunks were encoded) with a query
configuration; the same candidate on two models is the same encode option and query configuration, each model on
its own default store (SmolLM2: neutral-wrapped; Qwen: plain).
Usage: python rule.py RUNS OUT.json   (RUNS: the directory holding the workdirs; the TTFT figures come from this
directory's summaries or the quiet runs' rows in the workdirs, each named in the output)"""
import json
import sys
from pathlib import Path

from sparsecache.measure.stats import wilson

runs, out = Path(sys.argv[1]), sys.argv[2]
here = Path(__file__).parent
BUDGET = 0.5
s1 = json.load(open(here / "summary.json"))["labels"]  # run.sh / ttft.sh (the first session)
s2 = {(e["store"], e["label"]): e for e in json.load(open(here / "summary2.json"))}  # after.sh / ttft2.sh


def quiet(work, label, full="full+first_layer=tokens"):
    """Mean TTFT of `label` over the first 10 questions of RUNS/work as a fraction of full prefill's, both timed in
    one quiet run (the labels with +prefill_under=0: qttft.sh, ttft2.sh, linked_ttft.sh)."""
    P = "+prefill_under=0"
    path = runs / work / "results.json"
    if not path.exists():
        return None
    rows = json.load(open(path))["rows"]
    first = {f"k8-{i:03d}" for i in range(10)}
    at = "@wrapped" if label.endswith("@wrapped") else ""
    t = [x["ttft_ms"] for x in rows if x["label"] == label.removesuffix(at) + P + at and x["question"] in first]
    f = [x["ttft_ms"] for x in rows if x["label"] == full + P and x["question"] in first]
    return round(sum(t) / sum(f), 3) if len(t) == len(f) == 10 else None


def ttft1(label):
    return s1.get(label, {}).get("ttft_quiet", {}).get("x_full")


def ttft2(store, label):
    return (s2.get((store, label), {}).get("ttft_quiet") or {}).get("x_full")


# (candidate, model, label, one-chunk workdir, two-chunk workdir, quiet TTFT x full, where that TTFT is from)
D = "infoflow+ttft_budget=0.5"
CANDIDATES = [
    ("prefix store, the default", "smollm2-135m", f"{D}+first_layer=tokens@wrapped", "i5-dev", "s2c-dev",
     ttft2("prefix", f"{D}+first_layer=tokens@wrapped"), "summary2.json"),
    ("prefix store, chunkflow", "smollm2-135m", "chunkflow+ttft_budget=0.5@wrapped", "i5-dev", "s2c-dev",
     ttft1("chunkflow+ttft_budget=0.5@wrapped"), "summary.json"),
    ("prefix store, legolink", "smollm2-135m", "legolink+ttft_budget=0.5@wrapped", "i5-dev", "s2c-dev",
     ttft1("legolink+ttft_budget=0.5@wrapped"), "summary.json"),
    ("prefix store, gate_margin 1", "smollm2-135m", f"{D}+gate_margin=1@wrapped", "i5-dev", "s2c-dev",
     ttft1(f"{D}+gate_margin=1@wrapped"), "summary.json"),
    ("prefix store, gate_margin 3", "smollm2-135m", f"{D}+gate_margin=3@wrapped", "i5-dev", "s2c-dev",
     ttft1(f"{D}+gate_margin=3@wrapped"), "summary.json"),
    ("prefix store, gate_coverage 0.8", "smollm2-135m", f"{D}+gate_coverage=0.8@wrapped", "i5-dev", "s2c-dev",
     ttft1(f"{D}+gate_coverage=0.8@wrapped"), "summary.json"),
    ("prefix store, gate_coverage 0.8 over budget 0.4", "smollm2-135m",
     "infoflow+ttft_budget=0.4+gate_coverage=0.8@wrapped", "i5-dev", "s2c-dev",
     ttft2("prefix", "infoflow+ttft_budget=0.4+gate_coverage=0.8@wrapped"), "summary2.json"),
    ("prefix store, gate_coverage 0.8 over budget 0.35", "smollm2-135m",
     "infoflow+ttft_budget=0.35+gate_coverage=0.8@wrapped", "i5-dev", "s2c-dev",
     ttft2("prefix", "infoflow+ttft_budget=0.35+gate_coverage=0.8@wrapped"), "summary2.json"),
    ("after 1 neighbour, the default", "smollm2-135m", f"{D}@wrapped", "nb-i5", "nb-s2c",
     ttft2("neighbours", f"{D}@wrapped"), "summary2.json"),
    ("after 1 neighbour, gate_coverage 0.8 over budget 0.4", "smollm2-135m",
     "infoflow+ttft_budget=0.4+gate_coverage=0.8@wrapped", "nb-i5", "nb-s2c",
     ttft2("prefix", "infoflow+ttft_budget=0.4+gate_coverage=0.8@wrapped"), "summary2.json (the prefix store's: same path)"),
    ("after 1 neighbour, chunkflow", "smollm2-135m", "chunkflow+ttft_budget=0.5@wrapped", "nb-i5", "nb-s2c",
     ttft1("chunkflow+ttft_budget=0.5@wrapped"), "summary.json (the prefix store's: same path; nbflow.sh; ttft3.sh's "
     "run on this store was too noisy to read: BENCHMARKS.md)"),
    ("after 2 neighbours, the default", "smollm2-135m", f"{D}@wrapped", "nb2-i5", "nb2-s2c",
     ttft2("neighbours", f"{D}@wrapped"), "summary2.json (after 1 neighbour's: same path)"),
    ("linked trailer, the default", "smollm2-135m", f"{D}@wrapped", "lk-i5", "lk-s2c",
     quiet("lk-i5", f"{D}@wrapped"), "lk-i5 (linked_ttft.sh)"),
    ("prefix store, the default", "qwen2.5-coder-0.5b", D, "q-i5", "q-s2c",
     quiet("q-i5", D), "q-i5 (qttft.sh)"),
    ("prefix store, chunkflow", "qwen2.5-coder-0.5b", "chunkflow+ttft_budget=0.5", "q-i5", "q-s2c",
     quiet("q-t2", "chunkflow+ttft_budget=0.5"), "q-t2 (qttft2.sh)"),
    ("prefix store, legolink", "qwen2.5-coder-0.5b", "legolink+ttft_budget=0.5", "q-i5", "q-s2c",
     quiet("q-t2", "legolink+ttft_budget=0.5"), "q-t2 (qttft2.sh)"),
    ("prefix store, gate_coverage 0.8 over budget 0.4", "qwen2.5-coder-0.5b",
     "infoflow+ttft_budget=0.4+gate_coverage=0.8", "q-i5", "q-s2c",
     quiet("q-t2", "infoflow+ttft_budget=0.4+gate_coverage=0.8"), "q-t2 (qttft2.sh)"),
    ("prefix store, gate_margin 1", "qwen2.5-coder-0.5b", f"{D}+gate_margin=1", "q-i5", "q-s2c",
     quiet("q-t4", f"{D}+gate_margin=1"), "q-t4 (qwen4.sh)"),
    ("prefix store, gate_margin 3", "qwen2.5-coder-0.5b", f"{D}+gate_margin=3", "q-i5", "q-s2c",
     quiet("q-t4", f"{D}+gate_margin=3"), "q-t4 (qwen4.sh)"),
    ("prefix store, gate_coverage 0.8", "qwen2.5-coder-0.5b", f"{D}+gate_coverage=0.8", "q-i5", "q-s2c",
     quiet("q-t4", f"{D}+gate_coverage=0.8"), "q-t4 (qwen4.sh)"),
    ("prefix store, gate_coverage 0.8 over budget 0.35", "qwen2.5-coder-0.5b",
     "infoflow+ttft_budget=0.35+gate_coverage=0.8", "q-i5", "q-s2c",
     quiet("q-t4", "infoflow+ttft_budget=0.35+gate_coverage=0.8"), "q-t4 (qwen4.sh)"),
    ("after 1 neighbour, gate_coverage 0.8 over budget 0.4", "qwen2.5-coder-0.5b",
     "infoflow+ttft_budget=0.4+gate_coverage=0.8", "qnb-i5", "qnb-s2c",
     quiet("q-t2", "infoflow+ttft_budget=0.4+gate_coverage=0.8"), "q-t2 (qttft2.sh; the plain store's: same path)"),
    ("after 2 neighbours, the default", "qwen2.5-coder-0.5b", D, "qnb2-i5", "qnb2-s2c",
     quiet("q-i5", D), "q-i5 (qttft.sh; the plain store's: same path; qwen4.sh)"),
    ("linked trailer, the default", "qwen2.5-coder-0.5b", f"{D}@wrapped", "lk-q-i5", "lk-q-s2c",
     quiet("lk-q-i5", f"{D}@wrapped"), "lk-q-i5 (qwen_linked_rows.sh; no header: Qwen's store is plain)"),
    ("after 1 neighbour, the default", "qwen2.5-coder-0.5b", D, "qnb-i5", "qnb-s2c",
     quiet("q-i5", D), "q-i5 (qttft.sh; the plain store's: same path)"),
    ("after 1 neighbour, chunkflow", "qwen2.5-coder-0.5b", "chunkflow+ttft_budget=0.5", "qnb-i5", "qnb-s2c",
     quiet("q-t2", "chunkflow+ttft_budget=0.5"), "q-t2 (qttft2.sh; the plain store's: same path; nbflow.sh)"),
]


# Qwen's levers (qwen3.sh) answered the first 341 of the 682 one-chunk questions: Qwen's rule compares every Qwen
# candidate on those (and all two-chunk ones); its two main candidates are also reported on every question (ALL)
FIRST = {"qwen2.5-coder-0.5b": 341}


def kept(work, label, first=None):
    """(kept, confident) of `label` on full prefill's confident questions in RUNS/work (the first `first` questions'
    where given); None until all of them are answered."""
    path = runs / work / "results.json"
    if not path.exists():
        return None
    rows = json.load(open(path))["rows"]
    within = (lambda q: int(q.split("-")[1]) < first) if first else (lambda q: True)
    full = {x["question"]: x for x in rows if x["label"] == "full" and within(x["question"])}
    confident = sum(1 for x in full.values() if x.get("confident"))
    sure = [x for x in rows if x["label"] == label and x["question"] in full and full[x["question"]].get("confident")]
    return (sum(bool(x["correct"]) for x in sure), len(sure)) if len(sure) == confident else None


ALL = [c for c in CANDIDATES if c[1] in FIRST and c[0] in ("prefix store, the default", "after 1 neighbour, the default")]
result = []
for (name, model, label, one, two, x_full, source), first in (
        [(c, FIRST.get(c[1])) for c in CANDIDATES] + [(c, None) for c in ALL]):
    e = {"candidate": name, "model": model, "label": label, "ttft_x_full": x_full, "ttft_from": source,
         **({"one_chunk_first": first} if first else {}), "in_rule": first == FIRST.get(model)}
    parts = [kept(one, label, first), kept(two, label)]
    for split, p in zip(("one_chunk", "two_chunk"), parts):
        if p:
            e[split] = {"kept": p[0], "confident": p[1], "ci95": wilson(*p)}
    if all(parts):
        k, n = parts[0][0] + parts[1][0], parts[0][1] + parts[1][1]
        e["pooled"] = {"kept": k, "confident": n, "share": round(k / n, 4), "ci95": wilson(k, n)}
    e["eligible"] = x_full is not None and x_full <= BUDGET
    result.append(e)

choice = {}
for model in ("smollm2-135m", "qwen2.5-coder-0.5b"):
    ok = [e for e in result if e["model"] == model and e["eligible"] and "pooled" in e and e["in_rule"]]
    choice[model] = max(ok, key=lambda e: e["pooled"]["ci95"][0])["candidate"] if ok else None
both = {}
for e in result:
    if "pooled" in e and e["in_rule"]:
        b = both.setdefault(e["candidate"], {"kept": 0, "confident": 0, "models": [], "eligible": True})
        b["kept"] += e["pooled"]["kept"]
        b["confident"] += e["pooled"]["confident"]
        b["models"].append(e["model"])
        b["eligible"] &= e["eligible"]
for b in both.values():
    b["ci95"] = wilson(b["kept"], b["confident"])
shared = {c: b for c, b in both.items() if len(b["models"]) == 2}
choice["both models"] = max((c for c, b in shared.items() if b["eligible"]), key=lambda c: shared[c]["ci95"][0],
                            default=None)
json.dump({"budget": BUDGET, "candidates": result, "both_models": shared, "chosen": choice}, open(out, "w"), indent=1)
for e in result:
    cells = [f"{s} {e[s]['kept']}/{e[s]['confident']} {e[s]['ci95']}" for s in ("one_chunk", "two_chunk", "pooled")
             if s in e]
    scope = f"first {e['one_chunk_first']}" if "one_chunk_first" in e else "all"
    print(f"{e['model']:19s} {e['candidate']:52s} {scope:9s} {e['ttft_x_full']}x {'ok' if e['eligible'] else '--'}  "
          + "; ".join(cells))
for c, b in shared.items():
    print(f"both models: {c:40s} {b['kept']}/{b['confident']} {b['ci95']} eligible {b['eligible']}")
print("chosen:", json.dumps(choice))
