"""`full`: prefill the prefix, every chunk's text and the question, no cache: the reference."""

from . import register
from .base import Method, Prefilled


class Full(Method):
    name = "full"
    summary = "prefill everything (no cache)"
    baseline = True

    def prefilled(self, qc, ids, q_ids, cfg, watch) -> Prefilled:
        from ...model.generate import full_prefill

        with watch.step("read"):
            seq = text_ids(qc.store, ids) + q_ids
        with watch.step("prefill"):
            logits, cache = full_prefill(seq, qc.model)
        qc.rates.observe("prefill_tokens_per_s", len(seq), watch["prefill"])
        return Prefilled(logits, cache, len(seq) - len(q_ids), 0, 4 * len(seq), list(ids))


def text_ids(store, ids: list[str]) -> list[int]:
    """The token ids full prefill reads for the chunks `ids` (in context order): the store's
    prefix and the chunks' text (`ContextLayout.text`: a wrapped store's soft tokens are not text)."""
    return store.layout().text(store.tokens(ids))


register(Full())
