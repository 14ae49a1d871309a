"""How often superposition's kept paths hold the chunks an answer needs, scored with or without
the wrapper's header K/V in each path (#52: on a wrapped store the default dropped the demo
question's answer chunk). Path scoring only, no generation: a cheap proxy for the dev split.

    python scripts/experiments/path_holds.py WORK OUT.json --k 8 [--model M] [--limit N]
"""

import argparse
import dataclasses
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("work", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--model", default="default")
    p.add_argument("--limit", type=int)
    args = p.parse_args()

    import torch
    from sparsecache.measure.suite import load_suite
    from sparsecache.measure.suite import chunk_ids_by_doc
    from sparsecache.query.blend import decode_chunks
    from sparsecache.model.generate import question_ids
    from sparsecache.query.methods.superposition import path_scores
    from sparsecache.query.session import Session
    from sparsecache.stopwatch import Stopwatch

    torch.set_num_threads(1)
    questions = load_suite(args.work)[args.k][:args.limit]
    rows = []
    for name in ("store", "store-wrapped"):
        s = Session(args.work / name, model=args.model)
        ids = chunk_ids_by_doc(s.store)
        h = s.store.header()
        n_head = 0 if h is None else len(h[0])
        for q in questions:
            chunks = [ids[d] for d in q.chunk_docs]
            need = {i for i, d in enumerate(q.chunk_docs) if d in q.docs}
            q_ids = question_ids(s.model, q.question, "")
            ch = decode_chunks(s.store, chunks, s.device, Stopwatch(s.device))
            variants = {"with": path_scores(ch, q_ids, s.model)[0]}
            if n_head:
                bare = dataclasses.replace(ch, tokens=[t[n_head:] for t in ch.tokens],
                                           kv=[(k[:, n_head:], v[:, n_head:]) for k, v in ch.kv])
                variants["without"] = path_scores(bare, q_ids, s.model)[0]
            for v, sc in variants.items():
                order = sorted(range(len(chunks)), key=sc.__getitem__, reverse=True)
                rows.append({"store": name, "scoring": v, "question": q.id, "hops": q.hops,
                             **{f"holds{n}": need <= set(order[:n]) for n in (1, 2, 3)}})
    summary = {}
    for r in rows:
        key = f"{r['store']}/{r['scoring']}"
        s = summary.setdefault(key, {"n": 0, "holds1": 0, "holds2": 0, "holds3": 0})
        s["n"] += 1
        for n in (1, 2, 3):
            s[f"holds{n}"] += r[f"holds{n}"]
    for key, s in summary.items():
        print(key, {m: round(s[m] / s["n"], 3) for m in ("holds1", "holds2", "holds3")}, "of", s["n"])
    args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
