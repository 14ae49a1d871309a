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
from sparsecache.codec.omp import PIVOT_TOL
from sparsecache.measure.machine import cpu_model

from omp_cpu_phases import heldout_problems  # this directory's: the same signals as the phases


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
    codec, problems = heldout_problems(a.tokens)
    threads, s, scr = torch.get_num_threads(), codec.config.sparsity, codec.screening
    out = {"cpu": cpu_model(), "threads": threads, "other": a.other, "rows": []}
    for kind, (y, D, G) in problems.items():
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
