"""Which dictionary-learning choices help? Short runs of `learn` on the same signals.

Every configuration trains n=8192, s=16 K/V dictionaries for --steps steps on the default
model's built-in calibration signals and reports held-out NMSE. Writes JSON to --out.
    python scripts/experiments/ablate_learning.py --steps 50 --out runs/ablate_learning.json
"""

import argparse
import json
import time
from dataclasses import asdict

import torch

from sparsecache.codec.dictionary import DictConfig
from sparsecache.codec.learn import TrainConfig, collect_signals, learn
from sparsecache.model import default_prefix_ids, load_model
from sparsecache.text.documents import builtin_documents

CONFIGS = {
    "paper: random init, plain GD lr 2e-3, raw vectors": dict(init="random", precondition=False, lr=2e-3,
                                                            lr_v=None, normalize=False, dead_after=10**9),
    "data init, unit vectors, plain GD lr 2e-3": dict(precondition=False, lr=2e-3, lr_v=None, dead_after=10**9),
    "+ dead-atom replacement (plain GD lr 2e-3)": dict(precondition=False, lr=2e-3, lr_v=None),
    "+ preconditioned lr 0.5 (shipped default at first)": dict(lr=0.5, lr_v=None),
    "+ preconditioned lr 0.1": dict(lr=0.1, lr_v=None),
    "+ preconditioned lr K 0.5, V 0.1 (default)": dict(lr=0.5, lr_v=0.1),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--out", default="runs/ablate_learning.json")
    args = ap.parse_args()
    model = load_model()
    prefix = default_prefix_ids(model)
    train, _ = collect_signals(model, builtin_documents("train"), 1, 256, 150_000, prefix)
    held, _ = collect_signals(model, builtin_documents("heldout"), 1, 256, 15_000, prefix)
    results = []
    for name, kw in CONFIGS.items():
        if args.only and not any(o in name for o in args.only):
            continue
        tcfg = TrainConfig(steps=args.steps, batch=args.batch, val_every=args.steps, patience=10**9, **kw)
        t = time.time()
        d = learn(train, held, DictConfig(8192, 16, 1), tcfg, model.fingerprint(), f"runs/ablate/{len(results)}",
                  progress=False)
        r = {"config": name, "heldout_nmse_k": d.meta["heldout_nmse"]["k"], "heldout_nmse_v": d.meta["heldout_nmse"]["v"],
             "seconds": round(time.time() - t, 1), "train": asdict(tcfg)}
        print(f"{name:55s} K {r['heldout_nmse_k']:.4f}  V {r['heldout_nmse_v']:.4f}  ({r['seconds']} s)", flush=True)
        results.append(r)
    with open(args.out, "w") as f:
        json.dump({"steps": args.steps, "batch": args.batch, "threads": torch.get_num_threads(), "results": results}, f,
                  indent=2)


if __name__ == "__main__":
    main()
