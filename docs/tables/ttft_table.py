"""BENCHMARKS.md's TTFT tables from `bench ttft --json` output: TTFT per method and k, then
the phase breakdown at the chosen k values (warm) and every cold row.

    python docs/tables/ttft_table.py docs/benchmarks/bench-ttft-cpu.json --breakdown 2,8,32
"""

from __future__ import annotations

import json

import click

from sparsecache.query.session import STEPS

PHASES = tuple(s for s in STEPS if s != "retrieve")  # `bench ttft` bypasses retrieval (timed once, apart)


def _name(row: dict) -> str:
    return row["method"] + (f" r={row['ratio']:g}" if row["ratio"] else "")


def ttft_table(rows: list[dict]) -> str:
    warm = [r for r in rows if r["page_cache"] == "warm"]
    ks = sorted({r["k"] for r in warm})
    methods = list(dict.fromkeys(r["method"] for r in warm))
    at = {(r["method"], r["k"]): r["ttft"] for r in warm}
    lines = ["| method | " + " | ".join(f"k={k}" for k in ks) + " |", "|" + " --- |" * (len(ks) + 1)]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(f"{at[m, k] / 1000:.2f} s" if (m, k) in at else "" for k in ks) + " |")
    return "\n".join(lines)


def breakdown_table(rows: list[dict], ks: list[int]) -> str:
    head = ["k", "method", "cache", "context tokens", "recomputed", "bytes read", *PHASES, "**TTFT**"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    chosen = [r for r in rows if r["page_cache"] == "warm" and r["k"] in ks] + \
             [r for r in rows if r["page_cache"] != "warm"]
    for r in chosen:
        cells = [str(r["k"]), _name(r), r["page_cache"], f"{r['context_tokens']:,}", f"{r['recomputed_tokens']:,}",
                 f"{r['bytes_read'] / 1e6:.1f} MB", *(f"{r[p]:,.0f}" for p in PHASES), f"**{r['ttft']:,.0f}**"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@click.command()
@click.argument("result", type=click.File())
@click.option("--breakdown", default="2,8,32", show_default=True, help="k values broken down by phase.")
def main(result, breakdown):
    rows = json.load(result)["rows"]
    click.echo(ttft_table(rows) + "\n\n" + breakdown_table(rows, [int(k) for k in breakdown.split(",")]))


if __name__ == "__main__":
    main()
