"""The CPU OMP kernel against another version of it (#82 item 3): the same codes, and how long each takes.

    git show 715b204:sparsecache/codec/_omp_cpu.py > /tmp/old_omp_cpu.py
    python scripts/experiments/omp_cpu_against.py /tmp/old_omp_cpu.py --tokens 2048 --json omp-against.json

Both kernels code the default model's K and V of `--tokens` held-out tokens with the default dictionary,
screened (the encode's) and exact, alternately twice (the best time of each is kept), in the same process
on the same signals; the codes must be equal bit for bit. The other kernel is loaded from its file
(compiled afresh: no numba cache).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time

import sparsecache  # noqa: F401  (before torch: it sets torch's OpenMP threads to wait passively)
import numpy as np
import torch

import sparsecache.codec._omp_cpu as current
from sparsecache.codec.coding import Codec
from sparsecache.codec.dictionary import Dictionary, shipped_dictionary
from sparsecache.codec.omp import PIVOT_TOL, gram
from sparsecache.codec.signals import to_signals
from sparsecache.measure.machine import cpu_model
from sparsecache.model import default_prefix_ids, extract_kv, load_model
from sparsecache.text.documents import builtin_documents


def load_kernel(path: str):
    """The kernel module in `path`, its package-relative import made absolute and its cache off."""
    source = open(path).read().replace("from . import numba_pool", "from sparsecache.codec import numba_pool")
    source = source.replace("cache=True, ", "")
    spec = importlib.util.spec_from_loader("other_omp_cpu", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, path, "exec"), module.__dict__)
    return module


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("other", help="the other kernel's source file (a version of codec/_omp_cpu.py)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of held-out text whose K/V is coded")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    other = load_kernel(a.other)
    model = load_model("default")
    d = Dictionary.load(shipped_dictionary(model.fingerprint()))
    codec = Codec(d, "float8")
    docs = builtin_documents("heldout")  # Python's documentation, the part no dictionary was learned on
    ids = model.tokenizer("\n\n".join(x.text for x in docs[:80]), add_special_tokens=False)["input_ids"][: a.tokens]
    k, v = extract_kv(model, [ids], default_prefix_ids(model))[0]
    threads, s, scr = torch.get_num_threads(), d.config.sparsity, codec.screening
    out = {"cpu": cpu_model(), "threads": threads, "other": a.other, "rows": []}
    for kind, kv in (("k", k), ("v", v)):
        kv = kv.float()
        if codec._scales[kind] is not None:
            kv = kv * codec.scales_on(kind, torch.device("cpu"))
        y = to_signals(kv, d.config.layers_per_signal).reshape(-1, d.config.layers_per_signal * model.m).contiguous()
        D = codec._atoms[kind].float()
        G = gram(D).contiguous().numpy()
        a0 = (y @ D).contiguous().numpy()
        for m, name in ((scr.candidates, "screened"), (0, "exact")):
            best, codes = {}, {}
            for which, kernel in (("other", other), ("current", current)) * 2:
                idx, coef = np.empty((y.shape[0], s), np.int64), np.empty((y.shape[0], s), np.float32)
                t = time.perf_counter()
                kernel.omp_codes(a0, G, s, idx, coef, threads, PIVOT_TOL, m, scr.refresh)
                best[which] = min(best.get(which, float("inf")), time.perf_counter() - t)
                codes[which] = idx, coef
            same = all(np.array_equal(x, y_) for x, y_ in zip(codes["other"], codes["current"]))
            row = {"kind": kind, "omp": name, "signals": int(y.shape[0]), "same_codes": same,
                   "other_s": best["other"], "current_s": best["current"], "speedup": best["other"] / best["current"]}
            out["rows"].append(row)
            print(f"{kind} {name:8s} {row['signals']} signals: other {row['other_s']:.2f} s, current "
                  f"{row['current_s']:.2f} s ({row['speedup']:.2f}x), same codes: {same}")
    print(f"{out['cpu']}, {threads} threads")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    sys.exit(0 if all(r["same_codes"] for r in out["rows"]) else 1)


if __name__ == "__main__":
    main()
