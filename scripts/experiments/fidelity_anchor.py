"""Offline enrichment on the fidelity suite: the same suite's store encoded with an anchor
(`encode-corpus --anchor`), every chunk coded after the prefix and the anchor text, then the
configurations answered from it against the plain store's full-prefill rows (full prefill does
not read the codes, so its answers are the plain store's).

    python scripts/experiments/fidelity_anchor.py --source W --work W2 --limit 60 \
        --methods none,superposition:0.5+paths=2,infoflow:0.25 \
        [--anchor-doc 0 | --anchor-doc central | --anchor-text TEXT] [--anchor-tokens 320] [--no-plain]

`--anchor-doc central` picks the anchor without looking at the questions: the corpus document
whose embedding (the store's embedder) has the highest mean cosine similarity to all others.
`--no-plain` skips re-encoding the plain store (its encode time is already known).
`--wrapper DIR` encodes the store with a learned chunk wrapper (`learn-wrapper`) instead of an anchor.

W is a `bench fidelity` workdir (its corpus, questions and results.json); W2 gets the anchored
store, results.json and encode.json (the encode's time and tokens, beside the plain store's
encode of the same corpus for the cost).
"""

import argparse
import json
import shutil
import time
from pathlib import Path


def central_document(texts: list[str]) -> int:
    """The document with the highest mean cosine similarity to the others (the embeddings are unit vectors)."""
    import numpy as np

    from sparsecache.kvstore.index import Embedder

    e = Embedder().embed(texts)
    return int(np.argmax((e @ e.mean(0))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--limit", type=int, default=60)
    p.add_argument("--methods", default="none,superposition:0.5+paths=2,infoflow:0.25")
    p.add_argument("--anchor-doc", default="0", help="the corpus document whose text is the anchor: an index or 'central'")
    p.add_argument("--anchor-tokens", type=int, default=None, help="cut the anchor to its first N tokens")
    p.add_argument("--no-plain", action="store_true", help="do not encode the plain store for the cost")
    p.add_argument("--wrapper", type=Path, default=None, help="a learn-wrapper directory: a wrapped store, no anchor")
    p.add_argument("--anchor-text", default=None, help="the anchor's text instead of a corpus document")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()

    from sparsecache.bench.fidelity import parse_configs, run_fidelity
    from sparsecache.codec.dictionary import Dictionary, shipped_dictionary
    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.measure.suite import load_suite
    from sparsecache.model import load_model
    from sparsecache.query.session import Session
    from sparsecache.store import StoreConfig

    args.work.mkdir(parents=True, exist_ok=True)
    for name in ("corpus.jsonl", "questions.json", "suite.json"):
        shutil.copy(args.source / name, args.work / name)
    docs = [json.loads(line) for line in (args.work / "corpus.jsonl").read_text().splitlines() if line.strip()]
    model = load_model("default", device=args.device)
    if args.anchor_text:
        anchor = args.anchor_text
    elif args.anchor_doc == "central":
        anchor = docs[central_document([d["text"] for d in docs])]["text"]
    else:
        anchor = docs[int(args.anchor_doc)]["text"]
    if args.anchor_tokens:
        ids = model.tokenizer(anchor, add_special_tokens=False)["input_ids"][:args.anchor_tokens]
        anchor = model.tokenizer.decode(ids)
    d = Dictionary.load(shipped_dictionary(model.fingerprint()))
    report = args.work / "encode.json"
    if not (args.work / "store").exists():
        t = time.perf_counter()
        from sparsecache.wrapper.apply import Wrapper

        wrapper = Wrapper.load(args.wrapper) if args.wrapper else None
        enriched = StoreConfig(wrapper=wrapper.digest()) if wrapper else StoreConfig(anchor=anchor)
        configs = (("anchored", enriched),) if args.no_plain else (("plain", StoreConfig()), ("anchored", enriched))
        for name, config in configs:
            start = time.perf_counter()
            encode_with([str(args.work / "corpus.jsonl")], args.work / name, d, model, config,
                        EncodeOptions(device=args.device), wrapper=wrapper if config.wrapper else None)
            t_name = time.perf_counter() - start
            json.dump({**(json.loads(report.read_text()) if report.exists() else {}), f"{name}_s": round(t_name, 1),
                       "anchor_tokens": len(model.tokenizer(anchor, add_special_tokens=False)["input_ids"]),
                       "anchor": None if args.wrapper else anchor, "wrapper": str(args.wrapper or "")},
                      open(report, "w"))
        shutil.rmtree(args.work / "plain", ignore_errors=True)
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
