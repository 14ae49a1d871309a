"""How an answer is scored against the truth and against full prefill's: whole-word
containment, the first sentence compared, the answer's value tokens, and the confidence rule
(#69) that says which of full prefill's right answers count for *kept*."""

from __future__ import annotations

import math
import re

from .stats import bootstrap, mean

# The confidence rule (#69), fixed before any figure was measured with it: full prefill is
# confident of an answer holding the true value when, at every token of that value in its
# answer, its chosen token's log-probability exceeds the runner-up's by at least ln 4.
CONFIDENT_MARGIN = math.log(4)
TOP_SUPPORT = 64  # full prefill's distribution at a value token: its top 64 tokens and the rest lumped


def answer_span(text: str) -> str:
    """The answer's first sentence, lower-cased, punctuation and repeated spaces removed:
    what `same_answer` compares (two answers that differ after it still agree)."""
    return _words(re.split(r"(?<=[.!?])\s|\n", text.strip(), maxsplit=1)[0])



def token_f1(answer: str, reference: str) -> float:
    """SQuAD's token F1 between two answers' words (lower-cased, punctuation dropped, counted with
    multiplicity): partial credit where `same_answer` gives none. Two empty answers agree (1.0)."""
    from collections import Counter

    a, b = _words(answer).split(), _words(reference).split()
    if not a or not b:
        return float(a == b)
    common = sum((Counter(a) & Counter(b)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(a), common / len(b)
    return 2 * precision * recall / (precision + recall)


def contains(answer: str, truth: str) -> bool:
    """The true value appears in the answer as whole words."""
    return f" {_words(truth)} " in f" {_words(answer)} "



def _words(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))



def value_positions(tokenizer, tokens: list[int], truth: str) -> list[int]:
    """The positions of `tokens` (an answer) whose text overlaps the first whole-word occurrence
    of `truth` in it (case-insensitive); [] when the answer does not contain it."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    found = re.search(r"(?<![A-Za-z0-9])" + re.escape(truth) + r"(?![A-Za-z0-9])", text, re.I)
    if found is None:
        return []
    ends = [len(tokenizer.decode(tokens[: i + 1], skip_special_tokens=True)) for i in range(len(tokens))]
    starts = [0] + ends[:-1]
    return [i for i, (a, b) in enumerate(zip(starts, ends)) if a < found.end() and b > found.start()]



def value_reference(logprobs, tokens: list[int], positions: list[int]) -> dict:
    """What full prefill's row keeps of its answer's value tokens: their positions, the smallest
    margin of the chosen token over the runner-up (log-probabilities [len(tokens), vocab]
    `logprobs` of its own steps), and at each position its top TOP_SUPPORT (ids, log-probs)."""
    import torch

    if not positions:
        return {"value_positions": [], "margin": None}
    lp = logprobs[positions]  # (P, V)
    top2 = lp.topk(2, -1).values
    support = lp.topk(TOP_SUPPORT, -1)
    assert all(int(lp[i].argmax()) == tokens[p] for i, p in enumerate(positions)), "not its own greedy tokens"
    return {"value_positions": positions, "margin": round(float((top2[:, 0] - top2[:, 1]).min()), 4),
            "value_support": [[ids.tolist(), [round(x, 5) for x in vals.tolist()]]
                              for ids, vals in zip(support.indices, support.values.to(torch.float64))]}



def value_figures(ref: dict, reference_logprobs) -> dict:
    """A configuration's agreement with full prefill's row `ref` at its value tokens, from its
    log-probabilities along full prefill's answer: the share of them where its top-1 token is full
    prefill's, and the mean KL(full || it) over full prefill's top tokens with the rest as one."""
    positions = ref.get("value_positions") or []
    if not positions:
        return {}
    agree, kls = 0, []
    for pos, (ids, ref_lp) in zip(positions, ref["value_support"]):
        q = reference_logprobs[pos].double()
        agree += int(q.argmax()) == ref["tokens"][pos]
        p_top = [math.exp(x) for x in ref_lp]
        q_top = q[ids].exp().tolist()
        p_rest, q_rest = max(0.0, 1 - sum(p_top)), max(1e-12, 1 - sum(q_top))
        kl = sum(p * (lp - math.log(max(qq, 1e-30))) for p, lp, qq in zip(p_top, ref_lp, q_top) if p > 0)
        kls.append(kl + (p_rest * math.log(p_rest / q_rest) if p_rest > 0 else 0.0))
    return {"value_agreement": round(agree / len(positions), 4), "value_kl": round(sum(kls) / len(kls), 5)}



def summarise_values(rows: list[dict]) -> dict:
    """The value tokens' agreement with full prefill (mean, bootstrap 95% interval) and mean KL
    over the rows that have them ({} where none does)."""
    valued = [r for r in rows if "value_agreement" in r]
    if not valued:
        return {}
    agree = [r["value_agreement"] for r in valued]
    return {"value_agreement": round(mean(agree), 4), "value_agreement_ci95": bootstrap(agree, mean),
            "value_kl": round(mean([r["value_kl"] for r in valued]), 4)}

