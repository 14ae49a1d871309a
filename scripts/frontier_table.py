"""BENCHMARKS.md's frontier table from `bench quality --json` output: one row per quality
(index coding is lossless), with the total ratio under each index coding side by side.

    python scripts/frontier_table.py docs/benchmarks/bench-quality.json
"""

from __future__ import annotations

import json
import re
import sys

CODINGS = (("", "packed"), ("+ef", "Elias–Fano"), ("+rice", "Rice"))


def base_label(method: str) -> str:
    return re.sub(r"\+(ef|rice)$", "", method)


def _num(x) -> str:
    return "not run" if x is None else f"{x:.2f}"


def table(result: dict) -> str:
    fusion = result["config"]["fusion"]
    ratio = result["config"]["recompute_ratio"]
    by_base: dict[str, dict[str, dict]] = {}
    for row in result["rows"]:
        suffix = row["method"][len(base_label(row["method"])):]
        by_base.setdefault(base_label(row["method"]), {})[suffix] = row
    head = ["method", *(f"total ratio, {name}" for _, name in CODINGS), "NMSE K", "NMSE V", "ppl vs exact", "KL",
            "top-1", "needle, none", f"needle, {fusion} r={ratio:g}"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for base, rows in sorted(by_base.items(), key=lambda kv: kv[1].get("+ef", kv[1][""])["ratio_total"]):
        r = rows[""]
        name = base if r["family"] == "sparsecache" else f"*{base}*"
        ratios = [f"{rows[s]['ratio_total']:.2f}×" if s in rows else "" for s, _ in CODINGS]
        ppl = r["ppl_reconstructed"] / r["ppl_exact"] - 1
        lines.append("| " + " | ".join([name, *ratios, f"{r['nmse_k']:.4f}", f"{r['nmse_v']:.4f}", f"{100 * ppl:+.1f}%",
                                         f"{r['kl']:.3f}", f"{100 * r['top1_agreement']:.1f}%",
                                         *(_num((r["needle"] or {}).get(f)) for f in ("none", fusion))]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(json.load(open(sys.argv[1]))))
