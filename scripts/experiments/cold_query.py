"""The first query of a process against the ones after it (#82 item 3): what a CLI query pays once.

    python scripts/experiments/cold_query.py demo.store --repeats 3 --json cold-query.json

Opens a Session as `sparsecache query` does (model, store, the codec's and embedder's warm-ups), then asks the same
question `--repeats` + 1 times with the default configuration, and prints each query's TTFT
breakdown: the first is what every CLI query pays (its process is new), the others what a
long-lived Session or server pays. Set-up (loading the model, opening the store) is timed apart.
"""

from __future__ import annotations

import argparse
import json
import time

import sparsecache  # noqa: F401  (before torch: it sets torch's OpenMP threads to wait passively)
from sparsecache.measure.machine import cpu_model
from sparsecache.query.session import Session

QUESTION = "Which RFC does the uuid module follow?"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store")
    ap.add_argument("--question", default=QUESTION)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    t = time.perf_counter()
    session = Session(a.store, warm_retrieval=True)  # as `sparsecache query` opens it (`ask`)
    setup = time.perf_counter() - t
    rows = []
    for i in range(a.repeats + 1):
        answer = session.query(a.question, max_new_tokens=1)
        rows.append({"query": "cold" if i == 0 else "warm", **answer.timings_ms,
                     "context_tokens": answer.context_tokens, "method": answer.method})
    steps = [k for k in rows[0] if k not in ("query", "context_tokens", "method")]
    print(f"{cpu_model()}: set-up {setup:.1f} s; {rows[0]['context_tokens']} context tokens, {rows[0]['method']}")
    print(" ".join(f"{s:>12}" for s in ["query"] + steps))
    for r in rows:
        print(" ".join([f"{r['query']:>12}"] + [f"{r[s]:12.1f}" for s in steps]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_model(), "setup_s": setup, "question": a.question, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
