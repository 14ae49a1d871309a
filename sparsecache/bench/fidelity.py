"""The fidelity suite: does the compressed path give full prefill's answer to ordinary questions?

Needle tasks ask for a planted number; users ask about what their documents say. This suite
generates documents about fictional entities (made-up names, so the model cannot know the
answers from training), one document per chunk, and ordinary questions about them in
several phrasings:

- one fact per question (a year, a count, a name, a place, a weekday, a colour);
- some questions need two chunks: the entity's document names a person, and the person's
  own document holds the fact asked (`hops` = 2);
- each question's context is k chunks as retrieval would give them: the answer's chunk(s)
  at random ranks among other entities' documents;
- two splits, `dev` (every choice is tuned on it) and `test` (measured once, for the final
  table), drawn from disjoint pools: name syllables, given names and question phrasings
  (`split=None` draws from all of them, as the suite did before it had splits).

What is scored, per configuration, each with a 95% interval. The reference is full prefill of
the same chunks in the same order, and the primary figure is fidelity to it (#69):

- `kept`: of the questions full prefill answers right *with confidence* (CONFIDENT_MARGIN,
  stated before anything was measured with it: its answer holds the true value, and at every
  token of that value its chosen token is at least 4x as likely as the runner-up), the share the
  configuration also answers right (Wilson interval);
- `disagreement`: (gains + losses) / n over all questions: right where full prefill is wrong,
  or wrong where it is right (beating full prefill is not fidelity);
- `value_agreement` and `value_kl`: teacher-forced along full prefill's answer, at the tokens of
  the answer's value only, whether the configuration's top-1 token is full prefill's and the KL
  divergence from full prefill's distribution (its top TOP_SUPPORT tokens and the rest as one);
- `holds_hops1` / `holds_hops2`: for a method that drops chunks, how often it kept every chunk
  the answer needs, for one- and two-chunk questions;

and, secondary: `correct` (the true value appears in the answer, full prefill's too);
`correct_vs_full` (its correct answers relative to full prefill's, capped at 1: beyond full
prefill is not the goal); `right_where_full_right` (the share of the questions full prefill gets
right that it gets right too, confident or not);
`token_agreement` (the fraction of full prefill's answer tokens the method's context predicts
when fed that answer, as `query --compare` computes it); `same_answer` (the answers' first
sentences are equal after normalising case, spaces and punctuation; on questions full prefill
gets wrong a small model's answers are unstable, so this one undercounts); mean TTFT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..durable import write_atomic
from ..errors import ConfigError
from ..measure.answers import (CONFIDENT_MARGIN, answer_span, contains, summarise_values, token_f1, value_figures,
                               value_positions, value_reference)
from ..measure.stats import bootstrap, mean, wilson
from ..measure.suite import Question
from ..query.config import TTFT_BUDGET

# #69's formats: (a) generated entity documents, (b) timetable records with look-alikes (held out:
# nothing is learned or chosen on it, `records.HELD_OUT`), (c) cloze over real text
FORMATS = ("entities", "records", "cloze")
SPLIT = "dev"  # what `bench fidelity` measures unless told: the test split is run once, at the end


# How an entity suite's contexts are made (its settings' "contexts"): retrieval's top k, or (the
# default for new suites, #79) the same with a two-chunk question's needed chunks placed among them
CONTEXTS = {"retrieval": "retrieval", "placed": "retrieval, two-chunk needed placed"}


def placed(hits: list[str], needed: list[str], k: int) -> list[str]:
    """k chunks: every needed one at a fixed rank, retrieval's best other chunks (its look-alikes)
    in their order around them. Needed chunk i of n goes to rank round((i + 1)·k / (n + 1)) − 1,
    whatever rank retrieval gave it (two of eight: the 3rd and the 5th, best first)."""
    if len(needed) > k:
        raise ValueError(f"{len(needed)} needed chunks do not fit a context of {k}")
    ranks = {round((i + 1) * k / (len(needed) + 1)) - 1: c for i, c in enumerate(needed)}
    others = iter(h for h in hits if h not in needed)
    return [ranks[r] if r in ranks else next(others) for r in range(k)]


def retrieved(session, suite: dict[int, list[Question]], place_needed: bool = False) -> dict[int, list[Question]]:
    """The suite with each question's context replaced by the k chunks `session`'s retrieval
    returns for it, best first (#69: distractors chosen by the store's own retrieval from the
    whole pool, look-alikes included), and its documents' chunks as the ones it needs. A
    question whose document retrieval misses is one full prefill cannot answer either; with
    `place_needed`, a two-chunk question gets both its chunks among the look-alikes (`placed`),
    since retrieval almost never returns both and blending is for what needs two."""
    from dataclasses import replace

    from ..measure.suite import chunk_ids_by_doc

    ids = chunk_ids_by_doc(session.store)

    def context(q: Question, k: int) -> list[str]:
        needed = [ids[d] for d in q.docs]
        if place_needed and len(needed) > 1:
            return placed([h["id"] for h in session.retrieve(q.question, k + len(needed))], needed, k)
        return [h["id"] for h in session.retrieve(q.question, k)]

    return {k: [replace(q, chunk_docs=[], chunks=context(q, k), needed=[ids[d] for d in q.docs]) for q in qs]
            for k, qs in suite.items()}


# ---------------------------------------------------------------- scoring


# ---------------------------------------------------------------- value tokens


# ---------------------------------------------------------------- running


# A configuration's `context`: "gold" answers from the chunks the answer needs alone (full
# prefill of them): the ceiling of any method that picks chunks.
GOLD = {"method": "full", "context": "gold"}


def parse_configs(spec: str) -> dict[str, dict]:
    """`ruler.parse_methods`, with the label `gold` too."""
    from ..query.spec import parse_methods

    return parse_methods(spec, {"gold": GOLD})


def run_fidelity(session, suite: dict[int, list[Question]], methods: dict[str, dict], results: Path | None = None,
                 max_new_tokens: int = 24, wrapped=None, confident_only: bool = False) -> list[dict]:
    """Every method on every question of every k, after full prefill's answer to it (with
    `confident_only`, only on the questions full prefill answers with confidence: what `kept`
    and the value-token figures read, at a fraction of the cost; the other figures then describe
    those questions only).

    One row per (k, method, question); with `results`, every row is saved as it is made and a
    rerun skips rows already there, so an interrupted run resumes where it stopped. A row says
    whether the context the method answered from still held the chunks the answer needs
    (`holds_answer`: a method may drop chunks). Methods marked `store: wrapped` answer from the
    session `wrapped` (the same corpus encoded with a learned wrapper)."""
    from ..measure.suite import chunk_ids_by_doc
    from .ruler import query_settings, sessions

    by_store = sessions(session, wrapped, methods)
    ids_of: dict = {}

    def chunk_ids(key, q: Question) -> tuple[list[str], list[str]]:
        """The question's context and needed chunk ids in the store `key`."""
        if q.chunks is not None:
            return q.chunks, q.needed
        if key not in ids_of:
            ids_of[key] = chunk_ids_by_doc(by_store[key].store)
        return [ids_of[key][d] for d in q.chunk_docs], [ids_of[key][d] for d in q.docs]

    rows = json.loads(results.read_text())["rows"] if results is not None and results.exists() else []
    if any(r["label"] == "full" and "confident" not in r for r in rows):
        raise ConfigError(f"{results} was made before full prefill's confidence was recorded (#69): "
                          "measure in a new --workdir")
    done = {(r["k"], r["label"], r["question"]) for r in rows}
    refs = {(r["k"], r["question"]): r for r in rows if r["label"] == "full"}
    for k, questions in suite.items():
        for label, cfg in {"full": {"method": "full"}, **methods}.items():
            query = query_settings(cfg)
            ask = by_store[cfg.get("store")]
            for q in questions:
                if (k, label, q.id) in done:
                    continue
                if confident_only and label != "full" and not refs[(k, q.id)]["confident"]:
                    continue
                context, needed = chunk_ids(cfg.get("store"), q)
                chunks = [c for c in context if cfg.get("context") != "gold" or c in needed]
                ref = refs.get((k, q.id))
                a = ask.query(q.question, chunks=chunks, max_new_tokens=max_new_tokens, logprobs=True,
                              answer_prefix=q.answer_prefix or "",
                              reference=None if ref is None else ref["tokens"], **query)
                row = {"k": k, "label": label, **cfg, "question": q.id, "hops": q.hops, "answer": a.answer,
                       "tokens": a.tokens, "correct": contains(a.answer, q.truth), "ttft_ms": a.timings_ms["ttft"],
                       "context_tokens": a.context_tokens, "recomputed_tokens": a.recomputed_tokens,
                       "ratio_used": a.recompute_ratio,  # the method's, given, or what a TTFT budget bought
                       "escalated": a.escalated,  # the confidence gate prefilled it after the blend
                       # retrieval's context held the chunks the answer needs; the method kept those it held
                       # (a chunk retrieval missed is no method's loss) and left out `dropped` of the context's
                       "retrieved_answer": set(needed) <= set(chunks),
                       "holds_answer": set(needed) & set(chunks) <= set(a.context_ids),
                       "dropped": len(set(chunks) - set(a.context_ids))}
                if ref is None:
                    positions = value_positions(ask.model.tokenizer, a.tokens, q.truth) if row["correct"] else []
                    row |= value_reference(a.logprobs, a.tokens, positions)
                    row["confident"] = row["correct"] and row["margin"] is not None and \
                        row["margin"] >= CONFIDENT_MARGIN
                    refs[(k, q.id)] = row
                else:
                    row |= {"same_answer": answer_span(a.answer) == answer_span(ref["answer"]),
                            "answer_f1": token_f1(answer_span(a.answer), answer_span(ref["answer"])),
                            "token_agreement": a.agreement, "full_correct": ref["correct"],
                            "full_confident": bool(ref.get("confident")),
                            **value_figures(ref, a.reference_logprobs)}
                rows.append(row)
                if results is not None:
                    write_atomic(results, json.dumps({"rows": rows}))
            mine = [r for r in rows if r["k"] == k and r["label"] == label]
            # --confident-only where full prefill answered none with confidence leaves a method nothing to answer
            print(line(k, label, summarise(mine)) if mine else f"k={k} {label:>24}  no questions to answer",
                  file=sys.stderr, flush=True)
    return rows


def line(k: int, label: str, s: dict) -> str:
    """One configuration's summary in a line (`-` where full prefill's own row has no figure)."""
    def f(key, spec=".2f"):
        return format(s[key], spec) if key in s else "-"
    return (f"k={k} {label:>24}  kept {f('kept')} {s.get('kept_ci95', '')} of {s.get('confident', '-')}  "
            f"disagree {f('disagreement')}  value tokens {f('value_agreement', '.3f')} kl {f('value_kl', '.3f')}  "
            f"correct vs full {f('correct_vs_full')}  same {f('same_answer')}  f1 {f('answer_f1')}  "
            f"correct {s['correct']:.2f}  "
            f"ttft {s['ttft_ms']:.0f} ms (p90 {s['ttft_p90_ms']:.0f})" + (f"  escalated {s['escalated']:.2f}" if "escalated" in s else ""))


def summarise(rows: list[dict], full: dict[str, dict] | None = None) -> dict:
    """One configuration's figures, each with a 95% interval (Wilson for shares, a paired
    bootstrap over the questions for ratios and means): correct; against full prefill's rows
    by question (`full`, else each row's `full_correct` and `full_confident`): kept (right
    where full prefill is confidently right), disagreement, the value tokens' agreement and KL,
    correct relative to full prefill's (capped at 1) and right where full prefill is right;
    agreement with full prefill's answer (same first sentence, token agreement); mean TTFT; by
    hops; how often the context held the answer's chunks, by hops, where a method dropped some."""
    n = len(rows)
    correct = [bool(r["correct"]) for r in rows]
    ttft = sorted(r["ttft_ms"] for r in rows)
    out = {"questions": n, "correct": sum(correct) / n, "correct_ci95": wilson(sum(correct), n),
           "ttft_ms": round(sum(ttft) / n, 1), "ttft_p90_ms": round(ttft[-(-9 * n // 10) - 1], 1)}  # nearest rank
    if any(r.get("escalated") for r in rows):  # the confidence gate: how often it prefilled after the blend
        out["escalated"] = round(sum(bool(r.get("escalated")) for r in rows) / n, 4)
    for hops in (1, 2):
        part = [r for r in rows if r["hops"] == hops]
        if part:
            out[f"correct_hops{hops}"] = round(sum(bool(r["correct"]) for r in part) / len(part), 4)
    if "same_answer" not in rows[0]:
        return out
    ref = [bool(full[r["question"]]["correct"]) if full is not None else bool(r["full_correct"]) for r in rows]
    sure = [bool(full[r["question"]].get("confident")) if full is not None else bool(r.get("full_confident"))
            for r in rows]
    if any(sure):
        kept = sum(c for c, s in zip(correct, sure) if s)
        out |= {"confident": sum(sure), "kept": round(kept / sum(sure), 4), "kept_ci95": wilson(kept, sum(sure))}
    out["disagreement"] = round(sum(c != f for c, f in zip(correct, ref)) / n, 4)
    out |= summarise_values([r for r, s in zip(rows, sure) if s])
    same = sum(r["same_answer"] for r in rows)
    agreement = [r["token_agreement"] for r in rows]
    out |= {"same_answer": same / n, "same_answer_ci95": wilson(same, n),
            "token_agreement": round(sum(agreement) / n, 4), "token_agreement_ci95": bootstrap(agreement, mean)}
    f1 = [r["answer_f1"] for r in rows if "answer_f1" in r]  # rows of a results.json from before 2026-12-05 have none
    if f1:
        out |= {"answer_f1": round(sum(f1) / len(f1), 4), "answer_f1_ci95": bootstrap(f1, mean)}
    if any(ref):
        both = sum(c and f for c, f in zip(correct, ref))
        out |= {"correct_vs_full": round(min(1.0, sum(correct) / sum(ref)), 4),
                "correct_vs_full_ci95": tuple(min(1.0, x) for x in bootstrap(list(zip(correct, ref)), _ratio)),
                "right_where_full_right": round(both / sum(ref), 4),
                "right_where_full_right_ci95": wilson(both, sum(ref)), "full_correct": sum(ref) / n}
    held = [r.get("holds_answer", True) for r in rows]
    if any(r.get("dropped", 0) for r in rows) or not all(held):  # a method that leaves chunks out
        out["drops_chunks"] = True
        out["holds_answer"] = round(sum(held) / n, 4)
        for hops in (1, 2):  # over the questions whose retrieved context held what the answer needs
            part = [r.get("holds_answer", True) for r in rows if r["hops"] == hops and r.get("retrieved_answer", True)]
            out[f"holds_hops{hops}_n"] = len(part)
            if part:
                out[f"holds_hops{hops}"] = round(sum(part) / len(part), 4)
    for hops in (1, 2):
        part = [r for r in rows if r["hops"] == hops]
        if part:
            out[f"same_answer_hops{hops}"] = round(sum(r["same_answer"] for r in part) / len(part), 4)
    return out


def _ratio(pairs) -> float:
    den = sum(f for _, f in pairs)
    return sum(c for c, _ in pairs) / den if den else float("nan")


def table(rows: list[dict]) -> list[dict]:
    """`summarise` of every (k, label) in the order the rows were made, each against full
    prefill's rows of the same k."""
    keys = list(dict.fromkeys((r["k"], r["label"]) for r in rows))
    full = {k: {r["question"]: r for r in rows if r["k"] == k and r["label"] == "full"} for k, _ in keys}
    return [{"k": k, "label": label, **summarise([r for r in rows if r["k"] == k and r["label"] == label],
                                                 full[k] or None)}
            for k, label in keys]


def by_context_length(rows: list[dict], k: int, bins: int = 4) -> list[dict]:
    """Full prefill's accuracy at k by context length: its questions in `bins` equal groups by
    context tokens, each with its token range, accuracy and share confident."""
    full = sorted((r for r in rows if r["k"] == k and r["label"] == "full"), key=lambda r: r["context_tokens"])
    out = []
    for i in range(bins):
        part = full[i * len(full) // bins:(i + 1) * len(full) // bins]
        if part:
            out.append({"k": k, "tokens": [part[0]["context_tokens"], part[-1]["context_tokens"]], "questions": len(part),
                        "correct": round(sum(bool(r["correct"]) for r in part) / len(part), 4),
                        "confident": round(sum(bool(r.get("confident")) for r in part) / len(part), 4)})
    return out


# The rules a default is chosen by, stated before they are applied: the keys compared, in order
# (a key "-x" prefers the lower x). #69's, `kept`: the highest lower bound of kept, then the
# value tokens' agreement, then the lower TTFT; a method that drops chunks is eligible only if it
# kept every needed chunk on >= 99% of one-chunk and >= 95% of two-chunk questions.
RULES = {"same_answer": ("same_answer", "token_agreement"),  # #34's (2026-11-26)
         "correct_vs_full": ("correct_vs_full", "right_where_full_right"),  # #51's (rewarded beating full prefill)
         "kept": ("kept_low", "value_agreement", "-ttft_ms")}  # #69's
RULE = "kept"
HOLDS = {1: 0.99, 2: 0.95}  # #69: the needed chunks a chunk-dropping method must keep, by hops


def pick_default(agreement: list[dict], ttft: list[dict], k: int = 8, budget: float = TTFT_BUDGET,
                 rule: str = RULE) -> dict:
    """A default chosen by `rule` (RULES): among the configurations whose mean TTFT at k is at
    most `budget` of full prefill's (both from `ttft`, one run), the one highest by the rule's
    keys (from `agreement`; both are `table` rows, possibly from different runs). Returns the
    merged rows (agreement, TTFT, its ratio to full prefill's, whether it is within the
    budget) and the chosen label."""
    times = {r["label"]: r["ttft_ms"] for r in ttft if r["k"] == k}
    if "full" not in times:
        raise ValueError(f"no full-prefill TTFT at k={k}")
    rows = []
    for r in agreement:
        if r["k"] != k or r["label"] == "full" or r["label"] not in times:
            continue
        ratio = times[r["label"]] / times["full"]
        # a method that leaves chunks out must be seen keeping the needed ones on both kinds of question
        holds = not r.get("drops_chunks") or all(r.get(f"holds_hops{h}_n", 1) > 0 and r.get(f"holds_hops{h}", 1.0)
                                                  >= share for h, share in HOLDS.items())
        rows.append({**r, "ttft_ms": times[r["label"]], "ttft_vs_full": round(ratio, 3),
                     "kept_low": r.get("kept_ci95", (0.0, 0.0))[0], "keeps_chunks": holds,
                     "within": ratio <= budget and (holds or rule != "kept")})
    eligible = [r for r in rows if r["within"]]
    keys = RULES[rule]
    chosen = max(eligible, key=lambda r: tuple(-r[key[1:]] if key.startswith("-") else r.get(key, 0.0)
                                               for key in keys))["label"] if eligible else None
    return {"k": k, "budget": budget, "rule": rule, "full_ttft_ms": times["full"], "chosen": chosen, "rows": rows}


def plot_frontier(picked: dict, out, title: str = "") -> None:
    """#69's frontier: each configuration's kept (95% interval) against its TTFT as a fraction of
    full prefill's, full prefill at (1, 1), the TTFT budget as a line and the chosen one circled
    (`picked`: `pick_default`'s result; hollow markers: not eligible, e.g. dropping needed chunks)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.8))
    ax.axvline(picked["budget"], color="grey", ls="--", lw=1, label=f"TTFT budget ({picked['budget']:g}x)")
    ax.plot([1.0], [1.0], "ks", label="full prefill")
    for i, r in enumerate(sorted(picked["rows"], key=lambda r: r["ttft_vs_full"])):
        if "kept" not in r:
            continue
        lo, hi = r["kept_ci95"]
        colour = f"C{i % 10}"
        ax.errorbar(r["ttft_vs_full"], r["kept"], yerr=[[r["kept"] - lo], [hi - r["kept"]]], fmt="o", capsize=3,
                    color=colour, mfc=colour if r["within"] else "none", label=r["label"])
        if r["label"] == picked["chosen"]:
            ax.plot(r["ttft_vs_full"], r["kept"], "o", ms=16, mfc="none", mec="black")
    ax.set_xlabel("mean TTFT / full prefill's")
    ax.set_ylabel("kept: full prefill's confident right answers kept")
    ax.set_ylim(-0.02, 1.05)
    ax.set_title(title or f"k = {picked['k']}: kept against TTFT (rule {picked['rule']}, chosen: {picked['chosen']})",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
