"""`cacheclip`: a small model's full-context pass picks the tokens (CacheClip's auxiliary
selector): `--selector-model`, or the main model truncated to `--selector-layers`."""

from . import register
from .base import Scorer


class CacheClip(Scorer):
    name = "cacheclip"
    summary = ("recompute what a small model's full-context pass attends to (--selector-model, or the first "
               "--selector-layers layers; CacheClip)")
    options = ("selector_model", "selector_layers")
    in_ttft_bench = False  # a full-context pass: slower than full prefill's quarter, measured apart

    def scores(self, ctx, q_ids, cfg, stack, selector=None):
        from ..blend import selector_scores
        from ..stack import as_stack

        sel = as_stack(selector) if selector is not None else None
        n = cfg.selector_layers or (sel.n_layers if sel else max(1, stack.n_layers // 4))
        return selector_scores(ctx, q_ids, sel or stack, n)


register(CacheClip())
