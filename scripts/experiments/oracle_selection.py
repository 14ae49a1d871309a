"""How much better than infoflow's choice a selection at the same ratio could be (#79 item 2: the
selector's headroom), on a `bench fidelity` workdir's confident questions.

    python scripts/experiments/oracle_selection.py --workdir /work/runs/dec-a-dev --store wrapped \\
        --questions 30 --ratio 0.1 --json oracle.json

For each question full prefill answered right with confidence (its row in WORKDIR/results.json),
the context is decoded (`none`), then every window of --window chunk tokens is recomputed *alone*
(with the question in the same pass) and scored by how much it raises the teacher-forced
log-probability of full prefill's value tokens (the answer's words that carry the fact). The oracle
recomputes the best-scoring windows up to the ratio's token budget. It is an estimate of a
selector's reach, not a selector and not a bound: it reads the reference answer, and it adds
windows' gains measured one at a time, which do not add (on the first Qwen question tried, infoflow's
own choice beat it); a sequential greedy (re-scoring after each pick) would be the stronger oracle. Beside it, on the same decoded context: nothing recomputed (`none`), infoflow's own
selection at the ratio, and a random selection of the same size. Per configuration: the share of
questions whose every value token is full prefill's top-1 (teacher-forced), and the mean
log-probability of the value tokens.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
from pathlib import Path

import sparsecache  # noqa: F401  (before torch: it sets torch's OpenMP threads to wait passively)
import torch

from sparsecache.model.cache import recompute
from sparsecache.model.generate import forced_logprobs, question_ids
from sparsecache.query import methods
from sparsecache.query.config import QueryConfig
from sparsecache.query.session import Session
from sparsecache.stopwatch import Stopwatch


def value_score(logits, ctx, q_len: int, ref: dict, model) -> tuple[float, bool]:
    """(summed log-probability of the reference's value tokens, whether each is the top-1), fed the
    reference's tokens after `logits` (teacher forcing) on `ctx`'s cache (extended in place)."""
    pos = ref["value_positions"]
    lp = forced_logprobs(logits, ctx.cache, ctx.length + q_len, ref["tokens"][: max(pos) + 1], model)
    tokens = torch.tensor([ref["tokens"][p] for p in pos])
    rows = lp[pos]
    return float(rows.gather(1, tokens[:, None]).sum()), bool((rows.argmax(1) == tokens).all())


def evaluate(ctx0, q_ids, ref, model, positions=None, cfg=None):
    """The value figures after recomputing `positions` (or after `fuse` with `cfg`) on a copy of ctx0."""
    ctx = copy.deepcopy(ctx0)
    if cfg is not None:
        logits, positions = cfg.spec.fuse(ctx, q_ids, cfg, model)
    else:
        logits = recompute(ctx, positions, model, q_ids=q_ids)
    score, right = value_score(logits, ctx, len(q_ids), ref, model)
    return score, right, positions


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="a bench fidelity workdir with full prefill's rows")
    ap.add_argument("--store", default="wrapped", choices=("wrapped", "plain"))
    ap.add_argument("--questions", type=int, default=30)
    ap.add_argument("--ratio", type=float, default=0.1)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    work = Path(a.workdir)
    from sparsecache.measure.suite import load_suite

    suite = load_suite(work)
    rows = json.loads((work / "results.json").read_text())["rows"]
    refs = [r for r in rows if r["label"] == "full" and r.get("confident") and r["value_positions"]]
    questions = {(k, q.id): q for k, qs in suite.items() for q in qs}
    session = Session(work / ("store-wrapped" if a.store == "wrapped" else "store"))
    model, none = session.model, methods.get("none")
    infoflow = QueryConfig(method="infoflow", recompute_ratio=a.ratio, prefill_under=0)
    rng = random.Random(0)
    out = []
    torch.set_grad_enabled(False)
    for ref in refs[: a.questions]:
        q = questions[(ref["k"], ref["question"])]
        ids = q.chunks[::-1] if QueryConfig.order == "reverse" else list(q.chunks)
        q_ids = question_ids(model, q.question, q.answer_prefix or "")
        ctx0, _, _ = none.context(session.context(), ids, q_ids, QueryConfig(method="none"), Stopwatch(model.device))
        start = ctx0.prefix_len
        chunk_positions = torch.arange(start, ctx0.length)
        windows = list(chunk_positions.split(a.window))
        base, base_right, _ = evaluate(ctx0, q_ids, ref, model, torch.zeros(0, dtype=torch.long))
        gains = [evaluate(ctx0, q_ids, ref, model, w)[0] - base for w in windows]
        budget = round(a.ratio * chunk_positions.numel())
        chosen, n = [], 0
        for i in sorted(range(len(windows)), key=lambda i: -gains[i]):
            if n >= budget:
                break
            chosen.append(windows[i])
            n += windows[i].numel()
        oracle = torch.cat(chosen).sort().values if chosen else torch.zeros(0, dtype=torch.long)
        o_score, o_right, _ = evaluate(ctx0, q_ids, ref, model, oracle)
        i_score, i_right, i_pos = evaluate(ctx0, q_ids, ref, model, cfg=infoflow)
        rand = torch.cat(rng.sample(windows, max(1, len(chosen)))).sort().values
        r_score, r_right, _ = evaluate(ctx0, q_ids, ref, model, rand)
        overlap = len(set(oracle.tolist()) & set(i_pos.tolist())) / max(1, oracle.numel())
        row = {"question": q.id, "context_tokens": ctx0.length, "budget": budget,
               "none": {"logprob": base, "right": base_right}, "infoflow": {"logprob": i_score, "right": i_right,
                                                                           "recomputed": int(i_pos.numel())},
               "oracle": {"logprob": o_score, "right": o_right, "recomputed": int(oracle.numel())},
               "random": {"logprob": r_score, "right": r_right, "recomputed": int(rand.numel())},
               "oracle_infoflow_overlap": overlap}
        out.append(row)
        print(json.dumps(row), flush=True)
    summary = {}
    for name in ("none", "random", "infoflow", "oracle"):
        summary[name] = {"value_tokens_right": sum(r[name]["right"] for r in out) / max(1, len(out)),
                         "mean_value_logprob": sum(r[name]["logprob"] for r in out) / max(1, len(out))}
    summary["questions"] = len(out)
    summary["ratio"] = a.ratio
    summary["mean_oracle_infoflow_overlap"] = sum(r["oracle_infoflow_overlap"] for r in out) / max(1, len(out))
    print(json.dumps(summary, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "rows": out}, indent=1))


if __name__ == "__main__":
    main()
