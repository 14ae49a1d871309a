"""How far each query configuration's next-token distributions are from full prefill's, along full
prefill's own answer, on every question of a `bench fidelity` entities workdir (confident or not):
a continuous, paired measure beside `kept`, which reads only the value tokens of the questions full
prefill answers with confidence (#79 item 1: is exact K/V at r = 0.1 really further from full prefill
than the codes?).

Per question: full prefill of the question's context (the wrapped store's chunks laid out as text),
its greedy answer and log-probabilities; then each configuration over the wrapped store, teacher-forced
along that answer: mean KL(full || configuration) per token, top-1 agreement, and whether its own
answer holds the truth. Resumes from OUT. Then the paired summary: mean KL with a bootstrap interval
per configuration, and the paired differences named by --compare.

    python scripts/experiments/answer_kl.py WORKDIR OUT.json --questions 60 \\
        --config 'codes0={"method":"none"}' \\
        --config 'raw.1={"method":"infoflow","recompute_ratio":0.1,"source":"raw"}' \\
        --compare codes0:raw.1

A configuration may name an oracle selector ("oracle": "grad", "attention", "deviation", ..., below): the selector's
headroom, what a better choice of the same number of tokens could buy.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time


# An oracle's selection (#79 item 2: the selector's headroom). A configuration with "oracle" runs its
# method with the scorer's scores replaced by ones computed with what a query cannot know: full
# prefill's K/V of the same layout (every context token recomputed) and, for "grad", full prefill's
# answer. The same count of tokens is recomputed as the method's ratio asks.
# - "grad": the first-order decrease of the KL along that answer from giving a token its exact K/V at
#   every layer, -sum_l <dKL/dK_l, K_l* - K_l> + <dKL/dV_l, V_l* - V_l>, one backward pass over the
#   decoded cache;
# - "attention": infoflow's own score (the question's attention at 3/4 of the depth) read over full
#   prefill's K/V instead of the chunks computed apart;
# - "deviation": the token's relative K/V error summed over layers (CacheBlend's signal at every
#   layer, with the truth instead of a one-layer estimate);
# - "grad-self": "grad" with the loss a query can know, its own first token's NLL;
# - "gradnorm", "gradnorm-self": the gradient's size times the K/V's per token (no exact K/V), with
#   either loss: the last one needs nothing a query lacks (a backward pass of the question);
# - "grad-draft", "gradnorm-draft": the loss is the NLL of the answer the decoded cache gives without
#   recomputation (greedy, as long as full prefill's), which a query could know.
ORACLE: dict = {}


def oracle_scores(ctx, q_ids: list[int], model, kind: str, reference: list[int], ref_logprobs):
    import torch
    from transformers import DynamicCache

    from sparsecache.model.cache import Context, recompute

    P, S = ctx.prefix_len, ctx.length
    with torch.inference_mode(False):
        decoded = [(lay.keys[:, :, :S].clone(), lay.values[:, :, :S].clone()) for lay in ctx.cache.layers]

    def exact():  # full prefill's K/V of this layout: every context token recomputed
        with torch.inference_mode(False):
            full = Context(DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in decoded]),
                           ctx.token_ids, P, ctx.spans)
        with torch.inference_mode():
            recompute(full, torch.arange(P, S, device=ctx.token_ids.device), model)
        with torch.inference_mode(False):
            return full, [(lay.keys[:, :, :S].clone(), lay.values[:, :, :S].clone()) for lay in full.cache.layers]

    if kind == "attention":  # infoflow's own score, read over full prefill's K/V instead of the blind chunks'
        from sparsecache.query.blend import attention_scores
        from sparsecache.query.methods.base import infoflow_layer

        with torch.inference_mode():
            return attention_scores(exact()[0], q_ids, model, infoflow_layer(model.n_layers)).float().cpu()
    if kind == "deviation":
        score = torch.zeros(S)
        for (k, v), (ke, ve) in zip(decoded, exact()[1]):
            for a, b in ((k, ke), (v, ve)):
                score += (b - a).pow(2).sum((0, 1, 3)) / b.pow(2).sum((0, 1, 3)).mean().clamp_min(1e-12)
        return score
    target, combine = {"grad": ("full", "delta"), "grad-self": ("self", "delta"), "gradnorm": ("full", "norm"),
                       "gradnorm-self": ("self", "norm"), "grad-draft": ("draft", "delta"),
                       "gradnorm-draft": ("draft", "norm")}[kind]
    if target == "draft":  # the answer this cache gives without recomputation, greedy (a query could know it)
        draft = _greedy(model, decoded, q_ids, S, len(reference))
    with torch.inference_mode(False), torch.enable_grad():
        leaves = [(k.clone().requires_grad_(), v.clone().requires_grad_()) for k, v in decoded]
        cache = DynamicCache(ddp_cache_data=leaves)
        tail = list(reference[:-1]) if target == "full" else draft[:-1] if target == "draft" else []
        ids = torch.tensor([list(q_ids) + tail], device=ctx.token_ids.device)
        pos = torch.arange(S, S + ids.shape[1], device=ids.device)[None]
        out = model.hf(input_ids=ids, position_ids=pos, **{model.cache_arg: cache}, use_cache=True)
        logp = out.logits[0, len(q_ids) - 1:].float().log_softmax(-1)
        if target == "full":  # KL from full prefill along its answer
            ref = ref_logprobs.to(logp.device)
            loss = (ref.exp() * (ref - logp)).sum(-1).mean()
        elif target == "draft":  # the NLL of the cache's own greedy answer
            loss = -logp.gather(1, torch.tensor(draft, device=logp.device)[:, None]).mean()
        else:  # what a query knows: the NLL of its own first token
            loss = -logp[0, logp[0].argmax()]
        grads = torch.autograd.grad(loss, [x for pair in leaves for x in pair])
    score = torch.zeros(S)
    if combine == "delta":  # the predicted decrease of the loss from the token's exact K/V
        for i, ((ke, ve), (k, v)) in enumerate(zip(exact()[1], leaves)):
            for g, truth, x in ((grads[2 * i], ke, k), (grads[2 * i + 1], ve, v)):
                score -= (g * (truth - x.detach())).sum((0, 1, 3))
    else:  # sensitivity alone: |gradient| x |K/V| per token, summed over layers
        for i, (k, v) in enumerate(leaves):
            for g, x in ((grads[2 * i], k.detach()), (grads[2 * i + 1], v.detach())):
                score += g.norm(dim=-1).mul(x.norm(dim=-1)).sum((0, 1))
    return score


def _greedy(model, kv, q_ids: list[int], S: int, n: int) -> list[int]:
    """Up to n tokens of the greedy answer over a copy of the cache `kv` ([(K, V)] per layer), as every
    answer is generated (`model.generate`: the question prefilled, then greedy; EOS not kept)."""
    import torch
    from transformers import DynamicCache

    from sparsecache.model.generate import greedy_continue, prefill

    with torch.inference_mode():
        cache = DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in kv])
        first = int(prefill(cache, q_ids, model).argmax())
        return greedy_continue(first, cache, S + len(q_ids), model, n) or [first]


def _patch_choose() -> None:
    """Route `methods.base.choose` through the oracle while ORACLE names one."""
    from sparsecache.query import blend
    from sparsecache.query.methods import base

    if getattr(base.choose, "oracle", False):
        return
    original = base.choose

    def choose(ctx, q_ids, cfg, model, selector=None, reuse=None):
        if not ORACLE.get("kind"):
            return original(ctx, q_ids, cfg, model, selector, reuse)
        scores = oracle_scores(ctx, q_ids, model, ORACLE["kind"], ORACLE["reference"], ORACLE["logprobs"])
        return blend.select(scores.to(ctx.token_ids.device), ctx, cfg.ratio, cfg.group_window, cfg.group_min)

    choose.oracle = True
    base.choose = choose


def measure(work: str, out: str, n: int, configs: dict[str, dict], store: str = "store-wrapped") -> list[dict]:
    import sparsecache  # noqa: F401  (before torch: its OpenMP workers then wait passively on a shared CPU)
    from sparsecache.durable import write_atomic
    from sparsecache.measure.answers import contains
    from sparsecache.measure.suite import chunk_ids_by_doc, load_suite
    from sparsecache.query.session import Session

    s = Session(f"{work}/{store}")
    suite = load_suite(work)[8][:n]
    ids_of = chunk_ids_by_doc(s.store)
    try:
        with open(out) as f:
            rows = json.load(f)
    except FileNotFoundError:
        rows = []
    done = {(r["q"], r["label"]) for r in rows}
    t0 = time.time()
    for i, q in enumerate(suite):
        todo = [label for label in configs if (q.id, label) not in done]
        if not todo:
            continue
        chunks = q.chunks if q.chunks is not None else [ids_of[d] for d in q.chunk_docs]
        common = dict(chunks=chunks, max_new_tokens=24, logprobs=True, prefill_under=0,
                      answer_prefix=q.answer_prefix or "")
        ref = s.query(q.question, method="full", **common)
        for label in todo:
            settings = dict(configs[label])
            ORACLE.update(kind=settings.pop("oracle", None), reference=ref.tokens, logprobs=ref.logprobs)
            if ORACLE["kind"]:
                _patch_choose()
            a = s.query(q.question, reference=ref.tokens, **common, **settings)
            ORACLE.clear()
            kl = (ref.logprobs.exp() * (ref.logprobs - a.reference_logprobs)).sum(-1)
            rows.append(dict(q=q.id, label=label, kl=float(kl.mean()), kl_first=float(kl[0]), agree=a.agreement,
                             correct=contains(a.answer, q.truth), full_correct=contains(ref.answer, q.truth)))
        write_atomic(out, json.dumps(rows))
        print(i, q.id, f"{time.time() - t0:.0f} s", " ".join(f"{r['label']}={r['kl']:.3f}" for r in rows
                                                             if r["q"] == q.id), flush=True)
    return rows


def summarise(rows: list[dict], compare: list[tuple[str, str]]) -> dict:
    from sparsecache.measure.stats import bootstrap

    by: dict[str, dict] = collections.defaultdict(dict)
    for r in rows:
        by[r["label"]][r["q"]] = r
    qs = sorted(set.intersection(*(set(v) for v in by.values())))
    some = next(iter(by.values()))
    full_right = [q for q in qs if some[q]["full_correct"]]
    out: dict = {"questions": len(qs), "full_right": len(full_right), "configs": {}, "paired": {}}
    for label, got in by.items():
        kl = [got[q]["kl"] for q in qs]
        out["configs"][label] = {"kl": statistics.mean(kl), "kl_ci95": bootstrap(kl, statistics.mean),
                                 "top1_along_full": statistics.mean(got[q]["agree"] for q in qs),
                                 "right_where_full_right": sum(got[q]["correct"] for q in full_right)}
    for a, b in compare:
        d = [by[b][q]["kl"] - by[a][q]["kl"] for q in qs]
        out["paired"][f"{b} - {a}"] = {"kl": statistics.mean(d), "ci95": bootstrap(d, statistics.mean),
                                       "worse": sum(x > 0 for x in d), "of": len(d)}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workdir", help="a `bench fidelity --format entities --wrapper shipped` workdir (suite, stores)")
    p.add_argument("out", help="rows JSON (resumed); the summary goes beside it as OUT.summary.json")
    p.add_argument("--questions", type=int, default=60, help="the suite's first N questions at k = 8 (default 60)")
    p.add_argument("--config", action="append", default=[], metavar="LABEL=JSON",
                   help="a configuration: Session.query's settings as JSON (repeatable)")
    p.add_argument("--compare", action="append", default=[], metavar="A:B", help="report KL(B) - KL(A), paired")
    p.add_argument("--store", default="store-wrapped", help="the store answered from (default store-wrapped)")
    args = p.parse_args(argv)
    configs = {c.split("=", 1)[0]: json.loads(c.split("=", 1)[1]) for c in args.config}
    if configs:
        rows = measure(args.workdir, args.out, args.questions, configs, args.store)
    else:  # summarise rows already measured
        with open(args.out) as f:
            rows = json.load(f)
    summary = summarise(rows, [tuple(c.split(":", 1)) for c in args.compare])
    with open(args.out.removesuffix(".json") + ".summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    json.dump(summary, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
