"""`cake`: prefill the first chunks while the last ones are read and decoded, on two threads
(Cake's bidirectional overlap); `--cake-split` fixes how many are prefilled."""

from . import register
from .base import Method, Prefilled


class Cake(Method):
    name = "cake"
    summary = "prefill the first chunks while the last ones load, on two threads"
    options = ("cake_split",)

    def prefilled(self, qc, ids, q_ids, cfg, watch) -> Prefilled:
        import torch

        from ...model.cache import recompute
        from ...model.generate import prefill
        from ..overlap import cake_context

        lengths = [qc.store.chunk(c).token_length for c in ids]
        split = cfg.cake_split if cfg.cake_split is not None else qc.rates.split(lengths)
        with watch.step("recompute"):  # loading runs inside it, on a second thread
            ctx, computed, nbytes = cake_context(qc.store, ids, qc.model, split, cfg.first_layer == "tokens")
        links = qc.store.layout().links(ctx.spans[computed:])  # a linked wrapper's trailers of the decoded chunks
        with watch.step("prefill"):
            logits = (recompute(ctx, torch.tensor(links), qc.model, q_ids=q_ids) if links
                      else prefill(ctx.cache, q_ids, qc.model))
        recomputed = sum(b - a for a, b in ctx.spans[:computed])
        return Prefilled(logits, ctx.cache, ctx.length, recomputed, nbytes, list(ids))


register(Cake())
