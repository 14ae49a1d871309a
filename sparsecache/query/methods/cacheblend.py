"""`cacheblend`: recompute the tokens whose layer-1 values deviate most between a
full-context prefill and the cached K/V (CacheBlend)."""

from . import register
from .base import Scorer


class CacheBlend(Scorer):
    name = "cacheblend"
    summary = "recompute the tokens whose layer-1 values deviate most from full prefill's (CacheBlend)"

    def scores(self, ctx, q_ids, cfg, stack, selector=None):
        from ..blend import value_deviation

        return value_deviation(ctx, stack, cfg.layer(stack.n_layers))


register(CacheBlend())
