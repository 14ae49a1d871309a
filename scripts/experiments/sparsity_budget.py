"""Where to spend a store's bytes: one dictionary coded at several (s_K, s_V), every held-out
domain, all methods on the same passages (exact K/V and logits computed once per passage).
fp8 coefficients and Elias–Fano indices, as a store writes them, unless a plan says fp16.
BENCHMARKS.md, "Spending the 20× budget".

    python scripts/experiments/sparsity_budget.py dictionaries/smollm2-135m-n8192-s32-L5 \\
        calib/heldout/manual-de calib/heldout/python-docs --out sparsity-budget.json \\
        --plan 32,32,float16 --plan 32,32 --plan 40,40 --plan 32,48

Cost: OMP grows with s², so each extra sparsity adds ~a baseline's OMP time (about 33 s a
passage for the four plans above on 2 CPU cores).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from sparsecache.bench.evaluate import EvalConfig, domain_name, fidelity, passages
from sparsecache.bench.frontier import Coder, FrontierConfig, Sparse, ratios
from sparsecache.measure.machine import cpu_model
from sparsecache.codec.dictionary import Dictionary
from sparsecache.model import load_model


def parse_plan(text: str) -> tuple[int, int, str]:
    """'K,V[,coef]' → (s_K, s_V, coefficient format)."""
    parts = text.split(",")
    return int(parts[0]), int(parts[1]), parts[2] if len(parts) > 2 else "float8"


def label(s_k: int, s_v: int, coef: str) -> str:
    return (f"s{s_k}" if s_k == s_v else f"k{s_k}v{s_v}") + {"float16": "-fp16", "float8": "-fp8"}.get(coef, f"-{coef}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dictionary")
    ap.add_argument("texts", nargs="+", help="held-out text, one domain each")
    ap.add_argument("--plan", action="append", default=None, metavar="K,V[,COEF]",
                    help="sparsity of K and V codes (and coefficient format, default float8); repeatable")
    ap.add_argument("--passages", type=int, default=8, help="passages per domain")
    ap.add_argument("--out", default="sparsity-budget.json")
    args = ap.parse_args()

    model = load_model()
    d = Dictionary.load(args.dictionary)
    plans = [parse_plan(p) for p in (args.plan or ["32,32,float16", "32,32", "40,40", "32,48"])]
    coders: dict[int, Coder] = {}  # one per sparsity: K and V codes are memoised per passage

    def coder(s: int) -> Coder:
        if s not in coders:
            coders[s] = Coder(replace(d, config=replace(d.config, sparsity=s)), f"s{s}")
        return coders[s]

    methods = {label(*p): Sparse(coder(p[0]), coder(p[1]), p[2], "elias-fano") for p in plans}
    cfg = EvalConfig(args.passages, 512, 64)
    result = {"dictionary": str(args.dictionary), "fingerprint": d.fingerprint(), "cpu": cpu_model(),
              "passages_per_domain": args.passages,
              # the store's total ratio, dictionaries spread over 1M tokens (FrontierConfig.corpus_tokens)
              "methods": {label(*p): {"sparsity_k": p[0], "sparsity_v": p[1], "coef": p[2],
                                      "total_ratio_1M_tokens": ratios(methods[label(*p)], model,
                                                                      FrontierConfig())["ratio_total"]}
                          for p in plans},
              "domains": {}}
    for text in args.texts:
        t0 = time.perf_counter()
        reports = fidelity(model, methods, passages(model, [text], cfg), cfg.prefix_tokens)
        name = domain_name(text)
        result["domains"][name] = {
            m: {**{k: v for k, v in r.items() if not k.endswith("per_layer")},
                "worst_layer_nmse_k": max(r["nmse_k_per_layer"]), "worst_layer_nmse_v": max(r["nmse_v_per_layer"])}
            for m, r in reports.items()}
        for m, r in result["domains"][name].items():
            ppl = 100 * (r["ppl_reconstructed"] / r["ppl_exact"] - 1)
            print(f"{name:>14} {m:>11} ({result['methods'][m]['total_ratio_1M_tokens']:.1f}x): "
                  f"top-1 {100 * r['top1_agreement']:.1f}%  ppl {ppl:+.1f}%  NMSE K/V {r['nmse_k']:.4f}/"
                  f"{r['nmse_v']:.4f}  worst V layer {r['worst_layer_nmse_v']:.2f}", flush=True)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))  # after every domain: a stop keeps what ran


if __name__ == "__main__":
    main()
