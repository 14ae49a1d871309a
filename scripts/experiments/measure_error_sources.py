"""Where a dictionary's perplexity cost comes from: the codes of K only, of V only, and of one
layer group of either (every other layer exact), against the codes of everything. Each
passage is coded once (fp8 coefficients, as a store writes them); the variants splice its
decoded groups into the exact K/V. BENCHMARKS.md, "Where the perplexity goes".

    python scripts/experiments/measure_error_sources.py dictionaries/smollm2-135m-n8192-s80-L10 \\
        calib/heldout/python-docs calib/heldout/licences --passages 4 --json error-sources.json

`--per-layer` decodes each layer alone instead of each group (BENCHMARKS.md, "Layer 0 from the
tokens": Qwen2.5's layer-0 keys); `--except k0,k1` adds a variant with every layer decoded but
those, which stay exact; `--model` as every command's.
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


class Except:
    """Every layer's codes except the layers `exact[kind]`, which stay exact."""

    def __init__(self, decoded: Decoded, exact: dict[str, list[int]]):
        self.decoded, self.exact = decoded, exact

    def roundtrip(self, kv: torch.Tensor, kind: str) -> torch.Tensor:
        out = self.decoded(kv, kind).clone()
        for i in self.exact.get(kind, []):
            out[i] = kv[i]
        return out


def exact_layers(spec: str) -> dict[str, list[int]]:
    """'k0,k1,v3' -> {'k': [0, 1], 'v': [3]}."""
    out: dict[str, list[int]] = {}
    for part in spec.split(","):
        out.setdefault(part[0], []).append(int(part[1:]))
    return out


def variants(decoded: Decoded, n_groups: int, L: int, per_layer: bool = False) -> dict[str, Part]:
    """'all', then per kind: all its groups, and each group alone (with `per_layer`, each layer
    alone: the rest of its group exact)."""
    out = {"all": Part(decoded, "kv", range(n_groups), L)}
    for kind in "kv":
        out[f"{kind}-all"] = Part(decoded, kind, range(n_groups), L)
        if per_layer:
            out.update({f"{kind}-l{i}": Part(decoded, kind, [i], 1) for i in range(n_groups * L)})
        else:
            out.update({f"{kind}-g{g}": Part(decoded, kind, [g], L) for g in range(n_groups)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dictionary")
    ap.add_argument("texts", nargs="+", help="held-out domains (files or folders)")
    ap.add_argument("--passages", type=int, default=4)
    ap.add_argument("--coef", default="float8", choices=["float16", "float8", "float32"])
    ap.add_argument("--json", help="write the reports here")
    ap.add_argument("--model", default="default", help="as every command's --model (default: the default model)")
    ap.add_argument("--per-layer", action="store_true", help="each layer's codes alone rather than each group's")
    ap.add_argument("--except", dest="exact", action="append", default=[], metavar="k0,k1",
                    help="also: every layer's codes but these (kind and layer), which stay exact; repeatable")
    ap.add_argument("--only-except", action="store_true", help="only 'all' and the --except variants")
    args = ap.parse_args()

    model = load_model(args.model)
    d = Dictionary.load(args.dictionary)
    L = d.config.layers_per_signal
    decoded = Decoded(Codec(d, args.coef))
    methods = ({"all": Part(decoded, "kv", range(model.n_layers // L), L)} if args.only_except
               else variants(decoded, model.n_layers // L, L, args.per_layer))
    methods.update({f"x-{spec}": Except(decoded, exact_layers(spec)) for spec in args.exact})
    cfg = EvalConfig(passages=args.passages)
    out = {"dictionary": args.dictionary, "model": args.model, "coef": args.coef, "passages": args.passages,
           "cpu": cpu_model(), "domains": {}}
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
