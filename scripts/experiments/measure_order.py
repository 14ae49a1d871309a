"""Does context order matter? The needle chunk ranked first, as retrieval ranks the relevant
chunk, then laid out `given` (rank 1 first, farthest from the question), `reverse` (rank 1
next to the question) or by `attention` (InfoFlow's reordering: each chunk scored alone by
the question's attention, most important next to the question). Same trials, same store,
every method; JSON to --out.

    python scripts/experiments/measure_order.py --store W/store --passkey W/passkey --out docs/benchmarks/order.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sparsecache.bench.passkey import ANSWER_PREFIX, load_trials
from sparsecache.measure.stats import wilson
from sparsecache.measure.machine import cpu_model
from sparsecache.query.session import Session

METHODS = "full:0,none:0,infoflow:0.15,a3:0.15,cacheclip:0.15"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--passkey", required=True, help="directory with trials.json (bench passkey's task)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--orders", default="given,reverse,attention")
    ap.add_argument("--methods", default=METHODS, help="method:ratio, comma-separated")
    args = ap.parse_args()
    s = Session(args.store)
    trials = load_trials(args.passkey)[: args.trials]
    docs = {d for t in trials for d in t.chunk_docs}  # the store may hold other documents too
    ids = {c.doc_id: c.id for c in s.store.chunks() if c.doc_id in docs}
    rows = []
    for method, ratio in ((m, float(r)) for m, r in (x.split(":") for x in args.methods.split(","))):
        for order in args.orders.split(","):
            if order == "attention" and method == "full":
                continue  # reordering scores decoded codes
            correct, ttft = 0, []
            for t in trials:
                needle = next(d for d in t.chunk_docs if d.startswith("needle"))
                ranked = [needle] + [d for d in t.chunk_docs if d != needle]  # retrieval's rank 1 first
                layout = {"order": "given", "reorder": "attention"} if order == "attention" else {"order": order}
                a = s.query(t.question, chunks=[ids[d] for d in ranked], method=method, recompute_ratio=ratio,
                            prefill_under=0, max_new_tokens=12, answer_prefix=ANSWER_PREFIX.format(key=t.key), **layout)
                correct += t.value in a.answer
                ttft.append(a.timings_ms["ttft"])
            row = {"method": method, "ratio": ratio, "order": order, "accuracy": correct / len(trials),
                   "interval95": wilson(correct, len(trials)), "trials": len(trials),
                   "ttft_ms": round(sum(ttft) / len(ttft), 1)}
            print(row, flush=True)
            rows.append(row)
    Path(args.out).write_text(json.dumps({"cpu": cpu_model(), "k": len(trials[0].chunk_docs), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
