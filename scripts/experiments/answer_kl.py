"""How far each query configuration's next-token distributions are from full prefill's, along full
prefill's own answer, on every question of a `bench fidelity` entities workdir (confident or not):
a continuous, paired measure beside `kept`, which reads only the value tokens of the questions full
prefill answers with confidence (#79 item 1: is exact K/V at r = 0.1 really further from full prefill
than the codes?).

Per question: full prefill of the question's context (the wrapped store's chunks laid out as text),
its greedy answer and log-probabilities; then each configuration over the wrapped store, teacher-forced
along that answer: mean KL(full || configuration) per token, top-1 agreement, and whether its own
answer holds the truth. Resumes from OUT. Then the paired summary: mean KL with a bootstrap interval
per configuration, and the paired differences named by --compare.

    python scripts/experiments/answer_kl.py WORKDIR OUT.json --questions 60 \\
        --config 'codes0={"method":"none"}' \\
        --config 'raw.1={"method":"infoflow","recompute_ratio":0.1,"source":"raw"}' \\
        --compare codes0:raw.1
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time


def measure(work: str, out: str, n: int, configs: dict[str, dict], store: str = "store-wrapped") -> list[dict]:
    import sparsecache  # noqa: F401  (before torch: its OpenMP workers then wait passively on a shared CPU)
    from sparsecache.durable import write_atomic
    from sparsecache.measure.answers import contains
    from sparsecache.measure.suite import chunk_ids_by_doc, load_suite
    from sparsecache.query.session import Session

    s = Session(f"{work}/{store}")
    suite = load_suite(work)[8][:n]
    ids_of = chunk_ids_by_doc(s.store)
    try:
        with open(out) as f:
            rows = json.load(f)
    except FileNotFoundError:
        rows = []
    done = {(r["q"], r["label"]) for r in rows}
    t0 = time.time()
    for i, q in enumerate(suite):
        todo = [label for label in configs if (q.id, label) not in done]
        if not todo:
            continue
        chunks = q.chunks if q.chunks is not None else [ids_of[d] for d in q.chunk_docs]
        common = dict(chunks=chunks, max_new_tokens=24, logprobs=True, prefill_under=0,
                      answer_prefix=q.answer_prefix or "")
        ref = s.query(q.question, method="full", **common)
        for label in todo:
            a = s.query(q.question, reference=ref.tokens, **common, **configs[label])
            kl = (ref.logprobs.exp() * (ref.logprobs - a.reference_logprobs)).sum(-1)
            rows.append(dict(q=q.id, label=label, kl=float(kl.mean()), kl_first=float(kl[0]), agree=a.agreement,
                             correct=contains(a.answer, q.truth), full_correct=contains(ref.answer, q.truth)))
        write_atomic(out, json.dumps(rows))
        print(i, q.id, f"{time.time() - t0:.0f} s", " ".join(f"{r['label']}={r['kl']:.3f}" for r in rows
                                                             if r["q"] == q.id), flush=True)
    return rows


def summarise(rows: list[dict], compare: list[tuple[str, str]]) -> dict:
    from sparsecache.measure.stats import bootstrap

    by: dict[str, dict] = collections.defaultdict(dict)
    for r in rows:
        by[r["label"]][r["q"]] = r
    qs = sorted(set.intersection(*(set(v) for v in by.values())))
    some = next(iter(by.values()))
    full_right = [q for q in qs if some[q]["full_correct"]]
    out: dict = {"questions": len(qs), "full_right": len(full_right), "configs": {}, "paired": {}}
    for label, got in by.items():
        kl = [got[q]["kl"] for q in qs]
        out["configs"][label] = {"kl": statistics.mean(kl), "kl_ci95": bootstrap(kl, statistics.mean),
                                 "top1_along_full": statistics.mean(got[q]["agree"] for q in qs),
                                 "right_where_full_right": sum(got[q]["correct"] for q in full_right)}
    for a, b in compare:
        d = [by[b][q]["kl"] - by[a][q]["kl"] for q in qs]
        out["paired"][f"{b} - {a}"] = {"kl": statistics.mean(d), "ci95": bootstrap(d, statistics.mean),
                                       "worse": sum(x > 0 for x in d), "of": len(d)}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workdir", help="a `bench fidelity --format entities --wrapper shipped` workdir (suite, stores)")
    p.add_argument("out", help="rows JSON (resumed); the summary goes beside it as OUT.summary.json")
    p.add_argument("--questions", type=int, default=60, help="the suite's first N questions at k = 8 (default 60)")
    p.add_argument("--config", action="append", default=[], metavar="LABEL=JSON",
                   help="a configuration: Session.query's settings as JSON (repeatable)")
    p.add_argument("--compare", action="append", default=[], metavar="A:B", help="report KL(B) - KL(A), paired")
    p.add_argument("--store", default="store-wrapped", help="the store answered from (default store-wrapped)")
    args = p.parse_args(argv)
    configs = {c.split("=", 1)[0]: json.loads(c.split("=", 1)[1]) for c in args.config}
    if configs:
        rows = measure(args.workdir, args.out, args.questions, configs, args.store)
    else:  # summarise rows already measured
        with open(args.out) as f:
            rows = json.load(f)
    summary = summarise(rows, [tuple(c.split(":", 1)) for c in args.compare])
    with open(args.out.removesuffix(".json") + ".summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    json.dump(summary, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
