"""BENCHMARKS' "Serving through vLLM" tables from `sparsecache bench vllm --out` JSON.

    python docs/tables/vllm_table.py docs/benchmarks/vllm-cpu.json
"""

from __future__ import annotations

import json
import sys


def ttft_table(rows: list[dict]) -> str:
    ks = sorted({r["k"] for r in rows})
    by = {(r["k"], r["config"]): r for r in rows}
    lines = ["| configuration | " + " | ".join(f"k = {k}" for k in ks) + " |", "| --- |" + " --- |" * len(ks)]
    for config in dict.fromkeys(r["config"] for r in rows):
        cells = []
        for k in ks:
            r = by.get((k, config))
            if r is None:
                cells.append("—")
            elif config == "full":
                cells.append(f"{r['ttft_ms'] / 1e3:.2f} s")
            else:
                cells.append(f"{r['ttft_ms'] / 1e3:.2f} s ({r['x_full']:.3f}×)")
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def needle_table(rows: list[dict]) -> str:
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    by = {(r["task"], r["config"]): r for r in rows}
    lines = ["| configuration | " + " | ".join(tasks) + " | mean |", "| --- |" + " --- |" * (len(tasks) + 1)]
    for config in dict.fromkeys(r["config"] for r in rows):
        cells, accs = [], []
        for task in tasks:
            r = by.get((task, config))
            if r is None:
                cells.append("—")
                continue
            correct = round(r["accuracy"] * r["trials"])
            accs.append(r["accuracy"])
            cells.append(f"{correct}/{r['trials']}")
        mean = f"{sum(accs) / len(accs):.2f}" if len(accs) == len(tasks) else "—"
        lines.append(f"| {config} | " + " | ".join(cells) + f" | {mean} |")
    return "\n".join(lines)


def main() -> None:
    result = json.loads(open(sys.argv[1]).read())
    if result.get("ttft"):
        print(ttft_table(result["ttft"]), end="\n\n")
    if result.get("needle"):
        print(needle_table(result["needle"]), end="\n\n")
    for r in result.get("throughput", []):
        print(f"- {r['config']}: {r['requests_per_s']} requests/s, mean TTFT {r['mean_ttft_ms']} ms "
              f"({r['requests']} requests, {r['wall_s']} s)")


if __name__ == "__main__":
    main()
