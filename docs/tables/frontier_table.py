"""BENCHMARKS.md's frontier table from `bench quality --json` output: one row per quality
(index coding is lossless), with the total ratio under each index coding side by side. A run
over several domains (`--text` repeated) adds the worst domain's columns, which the store's
default is chosen on.

    python docs/tables/frontier_table.py docs/benchmarks/bench-quality.json
"""

from __future__ import annotations

import json
import sys

from sparsecache.bench.frontier import INDEX_NAMES


def _num(x) -> str:
    return "not run" if x is None else f"{x:.2f}"


def _worst(r: dict) -> list[str]:
    """The worst-domain cells: its name and top-1, the highest perplexity increase of any
    domain, and the worst single layer's NMSE in any domain."""
    return [r["worst_domain"], f"{100 * r['worst_top1']:.1f}%", f"{100 * r['worst_ppl']:+.1f}%",
            f"{r['worst_layer_nmse_k']:.3f} / {r['worst_layer_nmse_v']:.2f}"]


def table(result: dict) -> str:
    fusion = result["config"]["fusion"]
    ratio = result["config"]["recompute_ratio"]
    by_quality: dict[str, dict] = {}  # quality label → index coding → row; a baseline's one size sits under packed
    for row in result["rows"]:
        by_quality.setdefault(row["quality"], {})[row["index"] or "packed"] = row
    needles = any(r["needle"] for r in result["rows"])  # a --skip-needles run leaves their columns out
    head = ["method", *(f"total ratio, {name}" for name in INDEX_NAMES.values()), "NMSE K", "NMSE V", "ppl vs exact", "KL",
            "top-1", *(["needle, none", f"needle, {fusion} r={ratio:g}"] if needles else [])]
    by_domain = any(len(r.get("domains", ())) > 1 for r in result["rows"])
    if by_domain:
        head += ["worst domain", "its top-1", "worst ppl", "worst layer NMSE K / V"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for label, rows in sorted(by_quality.items(), key=lambda kv: kv[1].get("elias-fano", kv[1]["packed"])["ratio_total"]):
        r = rows["packed"]
        name = label if r["family"] == "sparsecache" else f"*{label}*"
        ratios = [f"{rows[c]['ratio_total']:.2f}×" if c in rows else "" for c in INDEX_NAMES]
        ppl = r["ppl_reconstructed"] / r["ppl_exact"] - 1
        lines.append("| " + " | ".join([name, *ratios, f"{r['nmse_k']:.4f}", f"{r['nmse_v']:.4f}", f"{100 * ppl:+.1f}%",
                                         f"{r['kl']:.3f}", f"{100 * r['top1_agreement']:.1f}%",
                                         *(_num((r["needle"] or {}).get(f)) for f in ("none", fusion) if needles),
                                         *(_worst(r) if by_domain else [])]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(json.load(open(sys.argv[1]))))
