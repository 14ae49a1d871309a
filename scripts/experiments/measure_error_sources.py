"""Where a dictionary's perplexity cost comes from: the codes of K only, of V only, and of one
layer group of either (every other layer exact), against the codes of everything. Each
passage is coded once (fp8 coefficients, as a store writes them); the variants splice its
decoded groups into the exact K/V. BENCHMARKS.md, "Where the perplexity goes".

    python scripts/experiments/measure_error_sources.py dictionaries/smollm2-135m-n8192-s80-L10 \\
        calib/heldout/python-docs calib/heldout/licences --passages 4 --json error-sources.json
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from sparsecache.bench.evaluate import EvalConfig, domain_name, fidelity, passages
from sparsecache.measure.machine import cpu_model
from sparsecache.codec.coding import Codec
from sparsecache.codec.dictionary import Dictionary
from sparsecache.model import load_model


class Decoded:
    """decode(encode(·)) of the passage in hand, computed once per tensor for all variants."""

    def __init__(self, codec: Codec):
        self.codec, self.memo = codec, {}

    def __call__(self, kv: torch.Tensor, kind: str) -> torch.Tensor:
        key = (kv.data_ptr(), kind)
        if key not in self.memo:
            if len(self.memo) >= 2:  # a new passage: the previous one's K and V are done
                self.memo.clear()
            self.memo[key] = self.codec.roundtrip(kv, kind)
        return self.memo[key]


class Part:
    """Exact K/V except `kinds` in layer groups `groups`, which are decoded from their codes."""

    def __init__(self, decoded: Decoded, kinds: str, groups, layers_per_signal: int):
        self.decoded, self.kinds, self.groups, self.L = decoded, kinds, list(groups), layers_per_signal

    def roundtrip(self, kv: torch.Tensor, kind: str) -> torch.Tensor:
        if kind not in self.kinds:
            return kv
        out, rec = kv.clone(), self.decoded(kv, kind)
        for g in self.groups:
            out[g * self.L:(g + 1) * self.L] = rec[g * self.L:(g + 1) * self.L]
        return out


def variants(decoded: Decoded, n_groups: int, L: int) -> dict[str, Part]:
    """'all', then per kind: all its groups, and each group alone."""
    out = {"all": Part(decoded, "kv", range(n_groups), L)}
    for kind in "kv":
        out[f"{kind}-all"] = Part(decoded, kind, range(n_groups), L)
        out.update({f"{kind}-g{g}": Part(decoded, kind, [g], L) for g in range(n_groups)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dictionary")
    ap.add_argument("texts", nargs="+", help="held-out domains (files or folders)")
    ap.add_argument("--passages", type=int, default=4)
    ap.add_argument("--coef", default="float8", choices=["float16", "float8", "float32"])
    ap.add_argument("--json", help="write the reports here")
    args = ap.parse_args()

    model = load_model()
    d = Dictionary.load(args.dictionary)
    L = d.config.layers_per_signal
    decoded = Decoded(Codec(d, args.coef))
    methods = variants(decoded, model.n_layers // L, L)
    cfg = EvalConfig(passages=args.passages)
    out = {"dictionary": args.dictionary, "coef": args.coef, "passages": args.passages, "cpu": cpu_model(),
           "domains": {}}
    for text in args.texts:
        t = time.time()
        windows = passages(model, [text], cfg)
        reports = fidelity(model, methods, windows, cfg.prefix_tokens, progress=False)
        out["domains"][domain_name(text)] = reports
        print(f"{domain_name(text)} ({len(windows)} passages, {time.time() - t:.0f} s)", flush=True)
        for name, r in reports.items():
            dnll = math.log(r["ppl_reconstructed"] / r["ppl_exact"])
            print(f"  {name:8s} Δnll/token {dnll:+.4f}  perplexity {math.expm1(dnll):+.1%}  "
                  f"top-1 {r['top1_agreement']:.1%}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
