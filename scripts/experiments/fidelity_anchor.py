"""Offline enrichment on the fidelity suite: the same suite's store encoded with an anchor
(`encode-corpus --anchor`), every chunk coded after the prefix and the anchor text, then the
configurations answered from it against the plain store's full-prefill rows (full prefill does
not read the codes, so its answers are the plain store's).

    python scripts/experiments/fidelity_anchor.py --source W --work W2 --limit 60 \
        --methods none,superposition:0.5+paths=2,infoflow:0.25 [--anchor-doc 0 | --anchor-text TEXT]

W is a `bench fidelity` workdir (its corpus, questions and results.json); W2 gets the anchored
store, results.json and encode.json (the encode's time and tokens, beside the plain store's
encode of the same corpus for the cost).
"""

import argparse
import json
import shutil
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--limit", type=int, default=60)
    p.add_argument("--methods", default="none,superposition:0.5+paths=2,infoflow:0.25")
    p.add_argument("--anchor-doc", type=int, default=0, help="the corpus document whose text is the anchor")
    p.add_argument("--anchor-text", default=None, help="the anchor's text instead of a corpus document")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()

    from sparsecache.bench.fidelity import load_suite, parse_configs, run_fidelity
    from sparsecache.dictionary import Dictionary, shipped_dictionary
    from sparsecache.encoder import encode_corpus
    from sparsecache.model import load_model
    from sparsecache.session import Session
    from sparsecache.store import StoreConfig

    args.work.mkdir(parents=True, exist_ok=True)
    for name in ("corpus.jsonl", "questions.json", "suite.json"):
        shutil.copy(args.source / name, args.work / name)
    docs = [json.loads(line) for line in (args.work / "corpus.jsonl").read_text().splitlines() if line.strip()]
    anchor = args.anchor_text or docs[args.anchor_doc]["text"]
    model = load_model("default", device=args.device)
    d = Dictionary.load(shipped_dictionary(model.fingerprint()))
    report = args.work / "encode.json"
    if not (args.work / "store").exists():
        t = time.perf_counter()
        for name, config in (("plain", StoreConfig()), ("anchored", StoreConfig(anchor=anchor))):
            start = time.perf_counter()
            encode_corpus([str(args.work / "corpus.jsonl")], args.work / name, d, model, config, device=args.device)
            t_name = time.perf_counter() - start
            json.dump({**(json.loads(report.read_text()) if report.exists() else {}), f"{name}_s": round(t_name, 1),
                       "anchor_tokens": len(model.tokenizer(anchor, add_special_tokens=False)["input_ids"])},
                      open(report, "w"))
        shutil.rmtree(args.work / "plain")
        (args.work / "anchored").rename(args.work / "store")
        print(f"encoded in {time.perf_counter() - t:.0f} s: {report.read_text()}", flush=True)
    suite = {args.k: load_suite(args.work)[args.k][:args.limit]}
    results = args.work / "results.json"
    if not results.exists():
        ids = {q.id for q in suite[args.k]}
        rows = [r for r in json.loads((args.source / "results.json").read_text())["rows"]
                if r["k"] == args.k and r["label"] == "full" and r["question"] in ids]
        results.write_text(json.dumps({"rows": rows}))
    run_fidelity(Session(args.work / "store", model, args.device), suite, parse_configs(args.methods), results)


if __name__ == "__main__":
    main()
