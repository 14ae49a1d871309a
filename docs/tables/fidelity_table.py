"""BENCHMARKS.md's fidelity tables from two `bench fidelity` results files: answers from a run
over the whole suite (any device: answers are the same on a CPU and a GPU), TTFT from a run on
the CPU the rule is about (`--limit`), and a rule (`fidelity.RULES`) applied to them: #34's
`same_answer`, #51's `correct_vs_full` or #69's `kept` (the default), with #69's frontier plot.

    python docs/tables/fidelity_table.py ANSWERS.json TTFT.json [--rule kept] [--out rows.json] [--plot frontier.png]
"""

from __future__ import annotations

import json

import click

from sparsecache.bench.fidelity import RULE, RULES, pick_default, plot_frontier, table


def _rows(path: str) -> list[dict]:
    return table(json.load(open(path))["rows"])


def _ci(r: dict, key: str = "same_answer") -> str:
    lo, hi = r[f"{key}_ci95"]
    return f"[{lo:.2f}, {hi:.2f}]"


@click.command()
@click.argument("agreement", type=click.Path(exists=True, dir_okay=False))
@click.argument("ttft", type=click.Path(exists=True, dir_okay=False))
@click.option("--k", default=8, show_default=True)
@click.option("--rule", type=click.Choice(list(RULES)), default=RULE, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Also write the merged rows as JSON.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="kept against TTFT / full prefill's (rule kept).")
def main(agreement, ttft, k, rule, out, plot):
    r = pick_default(_rows(agreement), _rows(ttft), k, rule=rule)
    print(f"full prefill: {r['full_ttft_ms'] / 1000:.2f} s; chosen by the rule ({rule}): {r['chosen']}\n")
    if rule == "kept":
        print("| configuration | confident | kept [95%] | value top-1 | value KL | disagreement | needed chunks kept "
              "(1 / 2 chunks) | TTFT (CPU) | × full | eligible |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for x in sorted(r["rows"], key=lambda x: (-x.get("kept_low", 0), x["ttft_vs_full"])):
            holds = "all kept" if not x.get("drops_chunks") else " / ".join(
                f"{x[f'holds_hops{h}']:.2f}" if x.get(f"holds_hops{h}_n", 1) else "unmeasured" for h in (1, 2))
            print(f"| {x['label']} | {x.get('confident', 0)} | {x.get('kept', 0):.2f} {_ci(x, 'kept')} | "
                  f"{x.get('value_agreement', 0):.3f} | {x.get('value_kl', 0):.3f} | {x.get('disagreement', 0):.2f} | "
                  f"{holds} | {x['ttft_ms'] / 1000:.2f} s | {x['ttft_vs_full']:.2f} | {'yes' if x['within'] else 'no'} |")
        if plot:
            plot_frontier(r, plot)
    elif rule == "same_answer":
        print("| configuration | questions | same answer as full prefill [95%] | tokens | correct | TTFT (CPU) | × full | within half |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for x in sorted(r["rows"], key=lambda x: x["ttft_vs_full"]):
            print(f"| {x['label']} | {x['questions']} | {x['same_answer']:.2f} {_ci(x)} | {x['token_agreement']:.3f} | "
                  f"{x['correct']:.2f} | {x['ttft_ms'] / 1000:.2f} s | {x['ttft_vs_full']:.2f} | {'yes' if x['within'] else 'no'} |")
    else:
        print("| configuration | questions | correct vs full [95%] | right where full is right [95%] | correct | tokens "
              "| same answer | TTFT (CPU) | × full | within half |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for x in sorted(r["rows"], key=lambda x: -x["correct_vs_full"]):
            print(f"| {x['label']} | {x['questions']} | {x['correct_vs_full']:.2f} {_ci(x, 'correct_vs_full')} | "
                  f"{x['right_where_full_right']:.2f} {_ci(x, 'right_where_full_right')} | {x['correct']:.2f} | "
                  f"{x['token_agreement']:.3f} | {x['same_answer']:.2f} | {x['ttft_ms'] / 1000:.2f} s | "
                  f"{x['ttft_vs_full']:.2f} | {'yes' if x['within'] else 'no'} |")
    if out:
        json.dump(r, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
