"""`full`: prefill the prefix, every chunk's text and the question, no cache: the reference."""

from . import register
from .base import Method, Prefilled


class Full(Method):
    name = "full"
    summary = "prefill everything (no cache)"
    baseline = True

    def prefilled(self, qc, ids, q_ids, cfg, watch) -> Prefilled:
        from ..generate import full_prefill

        with watch.step("read"):
            prefix, _, _ = qc.store.prefix()
            tokens = qc.store.tokens(ids)
        seq = prefix + [t for c in tokens for t in c if t >= 0] + q_ids  # a wrapped store's soft tokens: not text
        with watch.step("prefill"):
            logits, cache = full_prefill(seq, qc.model)
        qc.rates.observe("prefill_tokens_per_s", len(seq), watch["prefill"])
        return Prefilled(logits, cache, len(seq) - len(q_ids), 0, 4 * len(seq), list(ids))


register(Full())
