"""The levers' figures from the two workdirs' results.json: kept per split and pooled (Wilson 95%), and the
TTFT of each label on the first 10 questions of #69's dev suite timed in ttft.sh's run (the questions none of
the labels had answered before it, so every row there was timed in that run, the CPU to itself), with the
mean and p90 of every label's rows on the confident questions besides.
Usage: python summarise.py I5_DEV S2C_DEV OUT.json"""
import json
import sys

from sparsecache.measure.stats import wilson

i5, s2c, out = sys.argv[1:]
LABELS = ["infoflow+ttft_budget=0.5+first_layer=tokens@wrapped", "chunkflow+ttft_budget=0.5@wrapped",
          "legolink+ttft_budget=0.5@wrapped", "legolink:1@wrapped", "infoflow+ttft_budget=0.5+gate_coverage=0.6@wrapped",
          "infoflow+ttft_budget=0.5+gate_coverage=0.8@wrapped", "chunkflow+ttft_budget=0.5+gate_coverage=0.8@wrapped",
          "infoflow+ttft_budget=0.5+gate_margin=1@wrapped", "infoflow+ttft_budget=0.5+gate_margin=3@wrapped",
          "infoflow:0.25+first_layer=tokens@wrapped", "none+first_layer=tokens@wrapped", "full+first_layer=tokens"]


def load(path):
    rows = json.load(open(path))["rows"]
    full = {r["question"]: r for r in rows if r["label"] == "full"}
    return rows, full


def kept(rows, full, label):
    sure = [r for r in rows if r["label"] == label and full[r["question"]].get("confident")]
    return sum(bool(r["correct"]) for r in sure), len(sure), sure


def pct(ts, q):
    ts = sorted(ts)
    return ts[-(-int(q * 10) * len(ts) // 10) - 1] if ts else None


one, two = load(i5), load(s2c)
first = [f"k8-{i:03d}" for i in range(10)]
timed = [q for q in first if not one[1][q].get("confident")]  # answered by every label only in ttft.sh's run
result = {"ttft_questions": timed, "labels": {}}
for label in LABELS:
    entry = {}
    for name, (rows, full) in (("one_chunk", one), ("two_chunk", two)):
        k, n, sure = kept(rows, full, label)
        if n:
            t = [r["ttft_ms"] for r in sure]
            entry[name] = {"kept": k, "confident": n, "share": round(k / n, 4), "ci95": wilson(k, n),
                           "same_answer": round(sum(r["same_answer"] for r in sure) / n, 4),
                           "value_agreement": round(sum(r.get("value_agreement", 0) for r in sure) / n, 4),
                           "escalated": round(sum(bool(r.get("escalated")) for r in sure) / n, 4),
                           "recomputed_tokens": round(sum(r["recomputed_tokens"] for r in sure) / n, 1),
                           "ttft_mean_ms": round(sum(t) / n, 1), "ttft_p90_ms": pct(t, 0.9)}
    if "one_chunk" in entry and "two_chunk" in entry:
        k = entry["one_chunk"]["kept"] + entry["two_chunk"]["kept"]
        n = entry["one_chunk"]["confident"] + entry["two_chunk"]["confident"]
        entry["pooled"] = {"kept": k, "confident": n, "share": round(k / n, 4), "ci95": wilson(k, n)}
    t = [r["ttft_ms"] for r in one[0] if r["label"] == label and r["question"] in timed]
    if len(t) == len(timed):
        entry["ttft_quiet"] = {"mean_ms": round(sum(t) / len(t), 1), "p90_ms": pct(t, 0.9)}
    result["labels"][label] = entry
full_t = result["labels"]["full+first_layer=tokens"]["ttft_quiet"]["mean_ms"]
for entry in result["labels"].values():
    if "ttft_quiet" in entry:
        entry["ttft_quiet"]["x_full"] = round(entry["ttft_quiet"]["mean_ms"] / full_t, 3)
json.dump(result, open(out, "w"), indent=1)
for label, e in result["labels"].items():
    parts = [f"{n} {e[n]['kept']}/{e[n]['confident']} {e[n]['ci95']}" for n in ("one_chunk", "two_chunk", "pooled") if n in e]
    q = e.get("ttft_quiet", {})
    print(f"{label:58s} {'; '.join(parts)}  quiet {q.get('mean_ms')} ms p90 {q.get('p90_ms')} x{q.get('x_full')}")
