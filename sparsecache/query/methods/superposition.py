"""`superposition`: answer from the chunks whose own path makes the question likeliest
(superposition prompting's path pruning: Merth et al., ICML 2024).

Each chunk's K/V was computed after the shared prefix alone, so "prefix + chunk i" is exactly
one of superposition prompting's paths, and nothing about it is approximate but the codec.
The question runs along every path at once (one run through the layers, `stack.Batch`, each
path over its own cache), each path is scored by log P(question | prefix + chunk), and only
the best `--paths` chunks are kept, the best next to the question:

- one path kept and nothing recomputed: the answer continues that path's own cache, whose
  question was prefilled by the scoring, so the whole method costs one batched pass of
  k × |question| tokens after decoding;
- otherwise the kept chunks are laid out together and fused as `infoflow` does at
  `--recompute-ratio` (r = 1: full prefill of the kept chunks).

A chunk the question does not name (the second hop of a two-hop question) scores low on its
own path: that is what `--paths 2` is for. The vLLM connector does not serve it: it injects
the KV of the prompt's chunks that vLLM was given, and dropping chunks changes the prompt.
"""

from . import register
from .base import AttentionScorer, Prefilled, infoflow_layer


class Superposition(AttentionScorer):
    name = "superposition"
    summary = ("keep the --paths chunks (2) whose own path makes the question likeliest, recompute --recompute-ratio "
               "(0.5) of them, answer (superposition prompting; drops chunks, so it is an option, not the default)")
    options = ("paths",)
    connector = False
    reorders = False
    sources = ("codes",)  # it decodes its chunks itself
    in_ttft_bench = False
    paths = 2  # #51's rule on the dev split: 2 paths at r = 0.5 (its default until #69; docs/benchmarks-history.md)
    ratio = 0.5

    def layer(self, n_layers: int) -> int:
        return infoflow_layer(n_layers)

    def prefilled(self, qc, ids, q_ids, cfg, watch) -> Prefilled:
        from ..blend import decode_chunks

        chunks = decode_chunks(qc.store, ids, qc.device, watch, qc.model if cfg.first_layer == "tokens" else None)
        with watch.step("select"):
            scores, paths = path_scores(chunks, q_ids, qc.model)
            keep = min(cfg.paths or self.paths, len(ids))
            best = sorted(range(len(ids)), key=scores.__getitem__)[-keep:]  # the likeliest last, by the question
        if keep == 1 and not cfg.recomputes:
            ctx, logits = paths[best[0]]
            return Prefilled(logits, ctx.cache, ctx.length, 0, chunks.nbytes, [chunks.ids[best[0]]])
        kept = chunks.reordered(best)
        with watch.step("reconstruct"):
            ctx = kept.assemble(qc.model)
        logits, positions = self.fuse(ctx, q_ids, cfg, qc.model, watch, links=qc.store.layout().links(ctx.spans))
        return Prefilled(logits, ctx.cache, ctx.length, int(positions.numel()), chunks.nbytes, kept.ids)


def path_scores(chunks, q_ids: list[int], model) -> tuple[list[float], list]:
    """log P(q_ids[1:] | prefix + chunk i, q_ids[0]) for each chunk, and each path's
    (Context, next-token logits after the question): the question's K/V are in that context's
    cache, after the chunk."""
    import torch

    from ...model.cache import assemble
    from ...model.stack import Batch, Pass, as_stack

    stack = as_stack(model)
    ctxs = [assemble(chunks.prefix_ids, chunks.prefix_kv, [t], [kv], model) for t, kv in zip(chunks.tokens, chunks.kv)]
    q = torch.as_tensor(q_ids, dtype=torch.long, device=stack.device)
    n = len(q_ids)
    positions = [torch.arange(c.length, c.length + n, device=stack.device) for c in ctxs]
    with torch.inference_mode():
        logits = stack.run(q.repeat(len(ctxs)), torch.cat(positions), Batch([Pass(c.cache, p) for c, p in
                                                                              zip(ctxs, positions)]), logits="all")
        per = logits.view(len(ctxs), n, -1)
        logp = per[:, :-1].log_softmax(-1).gather(-1, q[1:].expand(len(ctxs), -1)[..., None])
    return logp.sum((1, 2)).tolist(), [(c, per[i, -1]) for i, c in enumerate(ctxs)]


register(Superposition())
