"""Held-out NMSE vs training step of dictionaries, from the history in their metadata.
    python docs/tables/plot_learning.py dictionaries/*/ --out docs/learning.png
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dictionaries", nargs="+")
    ap.add_argument("--out", default="docs/learning.png")
    args = ap.parse_args()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for path in args.dictionaries:
        meta = json.loads((Path(path) / "dictionary.json").read_text())
        h = meta["history"]
        label = f"n={meta['atoms']} s={meta['sparsity']} L={meta['layers_per_signal']}"
        for ax, kind in zip(axes, "kv"):
            ax.plot([r["step"] for r in h], [r[f"val_nmse_{kind}"] for r in h], label=label)
    for ax, kind in zip(axes, "KV"):
        ax.set(title=f"{kind}: held-out NMSE", xlabel="step", yscale="log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
