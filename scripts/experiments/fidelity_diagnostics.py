"""Why per-chunk KV loses answers: #51's diagnostics on a `bench fidelity` workdir (its store and
questions), default model, float32 on the CPU.

(a) k = 1: one chunk and its question. Full prefill's next-token distribution against the
    chunk's exact per-chunk KV (`raw`) and its decoded codes (`none`): KL and top-1 agreement
    (a chunk encoded alone after the prefix *is* full prefill of prefix + chunk, so raw must
    match to float error and none shows the codec alone).
(c) Where the question's attention goes at k chunks, per layer: the share on the shared
    prefix, on each chunk's first 1/4/16 tokens (extra attention sinks?), and on the rest,
    full prefill's cache against the per-chunk cache (`none`), averaged over heads, question
    tokens and questions. Sinks show as more mass on chunk starts; dilution as less mass on
    the answer's chunk.
(d) How often the best path by log P(question | prefix + chunk) holds the answer's chunk
    (`methods.superposition.path_scores`), by hops, and the rank of the answer's chunk.

    python scripts/experiments/fidelity_diagnostics.py --workdir /work/runs/fid-dev --k 8 --questions 40 \
        --out docs/benchmarks/fidelity-diagnostics-dev.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

import sparsecache  # noqa: F401  (before torch: OpenMP workers that do not spin)
import torch

from sparsecache.measure.suite import load_suite
from sparsecache.measure.suite import chunk_ids_by_doc
from sparsecache.measure.machine import cpu_model
from sparsecache.model.cache import Context, layout
from sparsecache.query.blend import attention_scores, decode_chunks
from sparsecache.model.generate import question_ids
from sparsecache.model.generate import full_prefill
from sparsecache.query.methods.superposition import path_scores
from sparsecache.query.session import Session
from sparsecache.stopwatch import Stopwatch

STARTS = (1, 4, 16)


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = p_logits.float().log_softmax(-1), q_logits.float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


def k1(session: Session, questions, ids: dict[str, str]) -> dict:
    rows = []
    for q in questions:
        chunk = ids[q.docs[-1]]
        full = session.query(q.question, chunks=[chunk], method="full", max_new_tokens=1).logits
        out = {}
        for method in ("raw", "none"):
            got = session.query(q.question, chunks=[chunk], method=method, max_new_tokens=1, prefill_under=0).logits
            out[method] = {"kl": _kl(full, got), "top1": int(full.argmax()) == int(got.argmax())}
        rows.append(out)
    return {m: {"kl_mean": sum(r[m]["kl"] for r in rows) / len(rows),
                "kl_max": max(r[m]["kl"] for r in rows),
                "top1": sum(r[m]["top1"] for r in rows) / len(rows)} for m in ("raw", "none")} | {"questions": len(rows)}


def _shares(scores: torch.Tensor, prefix_len: int, spans, answer: list[int], norm: float) -> dict:
    s = scores.float() / norm
    out = {"prefix": float(s[:prefix_len].sum())}
    for n in STARTS:
        out[f"chunk_first{n}"] = float(sum(s[a:min(b, a + n)].sum() for a, b in spans))
    out["chunks"] = float(sum(s[a:b].sum() for a, b in spans))
    out["answer_chunk"] = float(sum(s[spans[i][0]:spans[i][1]].sum() for i in answer))
    return out


def attention(session: Session, questions, ids: dict[str, str]) -> dict:
    model = session.model
    prefix = session.store.prefix()[0]
    per = {"full": [], "none": []}
    for q in questions:
        chunks = [ids[d] for d in q.chunk_docs][::-1]  # the default order: best next to the question
        answer = [i for i, d in enumerate(q.chunk_docs[::-1]) if d in q.docs]
        q_ids = question_ids(model, q.question)
        tokens = session.store.tokens(chunks)
        tok, plen, spans = layout(prefix, tokens, model.device)
        _, cache = full_prefill(tok.tolist(), model)
        full_ctx = Context(cache, tok, plen, spans)
        none_ctx = decode_chunks(session.store, chunks, model.device, Stopwatch(model.device)).assemble(model)
        norm = model.config.num_attention_heads * len(q_ids)
        for name, ctx in (("full", full_ctx), ("none", none_ctx)):
            per[name].append([_shares(attention_scores(ctx, q_ids, model, layer), plen, spans, answer, norm)
                              for layer in range(model.n_layers)])
    out = {}
    for name, runs in per.items():
        out[name] = [{key: sum(r[layer][key] for r in runs) / len(runs) for key in runs[0][layer]}
                     for layer in range(model.n_layers)]
    return out


def paths(session: Session, questions, ids: dict[str, str]) -> dict:
    rows = []
    for q in questions:
        chunks = [ids[d] for d in q.chunk_docs]
        decoded = decode_chunks(session.store, chunks, session.device, Stopwatch(session.device))
        scores, _ = path_scores(decoded, question_ids(session.model, q.question), session.model)
        order = sorted(range(len(chunks)), key=lambda i: -scores[i])
        ranks = [order.index(q.chunk_docs.index(d)) for d in q.docs]
        rows.append({"hops": q.hops, "best_holds_first": ranks[0] == 0, "ranks": ranks,
                     "top2_hold_all": all(r < 2 for r in ranks)})
    out = {}
    for hops in (1, 2):
        part = [r for r in rows if r["hops"] == hops]
        if part:
            out[f"hops{hops}"] = {"questions": len(part),
                                  "best_path_holds_the_named_chunk": sum(r["best_holds_first"] for r in part) / len(part),
                                  "top2_hold_every_needed_chunk": sum(r["top2_hold_all"] for r in part) / len(part),
                                  "mean_rank_of_each_needed_chunk": [sum(r["ranks"][i] for r in part) / len(part)
                                                                     for i in range(hops)]}
    return out


@click.command()
@click.option("--workdir", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--k", default=8, show_default=True)
@click.option("--questions", default=40, show_default=True, help="The first N questions of that k.")
@click.option("--out", type=click.Path(dir_okay=False), default=None)
def main(workdir, k, questions, out):
    torch.manual_seed(0)
    work = Path(workdir)
    session = Session(work / "store", "default", "cpu", dtype="float32")
    ids = chunk_ids_by_doc(session.store)
    qs = load_suite(work)[k][:questions]
    result = {"workdir": str(work), "k": k, "questions": len(qs), "cpu": cpu_model(),
              "settings": json.loads((work / "suite.json").read_text())}
    for name, fn in (("k1", k1), ("paths", paths), ("attention", attention)):
        print(f"{name} …", file=sys.stderr, flush=True)
        result[name] = fn(session, qs, ids)
        if name != "attention":
            print(json.dumps(result[name], indent=1), file=sys.stderr)
    att = result["attention"]
    for layer in range(0, len(att["full"]), 4):
        f, n = att["full"][layer], att["none"][layer]
        print(f"layer {layer:>2}: prefix {f['prefix']:.2f}/{n['prefix']:.2f}  chunk first-4 {f['chunk_first4']:.2f}/"
              f"{n['chunk_first4']:.2f}  answer chunk {f['answer_chunk']:.2f}/{n['answer_chunk']:.2f}  (full/none)",
              file=sys.stderr)
    if out:
        Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
