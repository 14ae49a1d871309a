"""Does a learned wrapper survive the codec? (#52 item 3, before stores carry wrappers.)

On a `learn-wrapper` output directory's dev questions (its eval.json: the dev split's first
questions and full prefill's answers), answers with nothing recomputed from:
  plain raw      per-chunk K/V after the prefix, exact (what `raw` reads)
  plain coded    the same through the store's codec (what `none` reads from a store today)
  wrapped raw    `prefix | header chunk trailer | …`, exact (the learning curve's figure)
  wrapped coded  chunk and trailer through the codec, prefix and header exact (what a wrapped
                 store would keep: the header's K/V is the same for every chunk)
and the codec's NMSE on chunk tokens against trailer tokens (and on the header, were it coded).

    python scripts/experiments/wrapper_codec.py WRAPPER_DIR [--limit N] [--out FILE.json]
"""

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("wrapper", type=Path)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--dict", default=None, help="dictionary directory (default: the model's shipped one)")
    args = p.parse_args()

    import torch

    from sparsecache.measure.answers import contains
    from sparsecache.codec.coding import Codec
    from sparsecache.codec.dictionary import Dictionary, shipped_dictionary
    from sparsecache.wrapper.learn import answer
    from sparsecache.model import default_prefix_ids, load_model
    from sparsecache.store import StoreConfig
    from sparsecache.wrapper.apply import Wrapper, wrapped_pieces

    model = load_model()
    w = Wrapper.load(args.wrapper)
    w.check_model(model)
    d = Dictionary.load(args.dict or shipped_dictionary(model.fingerprint()))
    cfg = StoreConfig()
    codec = Codec(d, cfg.coef_dtype, indices=cfg.index_coding)
    prefix = default_prefix_ids(model)
    saved = json.loads((args.wrapper / "eval.json").read_text())
    questions, full = saved["questions"][:args.limit], saved["full"][:args.limit]
    T = w.lengths[1]
    err = {name: [0.0, 0.0] for name in ("chunk_k", "chunk_v", "trailer_k", "trailer_v", "header_k", "header_v")}
    rows = {name: [] for name in ("plain raw", "plain coded", "wrapped raw", "wrapped coded")}

    def nmse(name, x, y):
        err[name][0] += float(((x - y) ** 2).sum())
        err[name][1] += float((x ** 2).sum())

    with torch.no_grad():
        for i, (q, f) in enumerate(zip(questions, full)):
            for wrapped in (False, True):
                pre, pieces = wrapped_pieces(model, q["chunks"], prefix, w.header if wrapped else None,
                                             w.trailer if wrapped else None)
                coded = []
                for (hk, hv), (bk, bv) in pieces:
                    ck, cv = codec.roundtrip(bk, "k"), codec.roundtrip(bv, "v")
                    if wrapped:
                        n = bk.shape[1] - T
                        for kind, x, y in (("k", bk, ck), ("v", bv, cv)):
                            nmse(f"chunk_{kind}", x[:, :n], y[:, :n])
                            nmse(f"trailer_{kind}", x[:, n:], y[:, n:])
                        if len(coded) == 0 and hk.shape[1]:
                            nmse("header_k", hk, codec.roundtrip(hk, "k"))
                            nmse("header_v", hv, codec.roundtrip(hv, "v"))
                    coded.append([(hk, hv), (ck, cv)])
                for label, use in (("raw", pieces), ("coded", coded)):
                    keys = torch.cat([pre[0]] + [k for piece in use for k, _ in piece], 1)
                    values = torch.cat([pre[1]] + [v for piece in use for _, v in piece], 1)
                    keys = model.rope.rotate(keys, torch.arange(keys.shape[1]))
                    text, _, agree = answer(model, keys, values, q["question"], f["tokens"])
                    rows[f"{'wrapped' if wrapped else 'plain'} {label}"].append(
                        {"id": q["id"], "correct": contains(text, q["truth"]), "full_correct": f["correct"],
                         "token_agreement": agree, "answer": text})
            print(i + 1, {k: sum(r["correct"] for r in v) for k, v in rows.items()}, flush=True)
    full_right = sum(f["correct"] for f in full)
    summary = {}
    for name, rs in rows.items():
        right = sum(r["correct"] for r in rs)
        summary[name] = {"correct": right / len(rs), "correct_vs_full": right / max(1, full_right),
                         "right_where_full_right": sum(r["correct"] and r["full_correct"] for r in rs) / max(1, full_right),
                         "token_agreement": sum(r["token_agreement"] for r in rs) / len(rs)}
    out = {"questions": len(questions), "full_correct": full_right / len(questions), "summary": summary,
           "nmse": {k: e / max(t, 1e-30) for k, (e, t) in err.items() if t}, "rows": rows,
           "wrapper": str(args.wrapper), "dictionary": d.config.__dict__ if hasattr(d.config, "__dict__") else None}
    for name, s in summary.items():
        print(f"{name:>14}: " + "  ".join(f"{k} {v:.3f}" for k, v in s.items()))
    print("NMSE", {k: round(v, 4) for k, v in out["nmse"].items()})
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
