"""Selective attention over chunks, for the tokens after the context (the question and the
answer): each head keeps only the chunks it attends to most and renormalises.

Chunks encoded alone each carry their own attention sinks and pull the question's attention
apart: the more parallel chunks, the higher its attention entropy ("Attention Entropy is a Key
Factor", ACL 2025). Its remedy, applied here at query time with nothing recomputed: for every
head and query token, score each chunk by the sum of its `TOP_TOKENS` largest attention
probabilities, keep the `n` best chunks (the prefix and the tokens after the context always
stay), zero the rest and renormalise.

It runs inside transformers' layers as an attention function (`AttentionInterface`), named in
the model's config only while `selective` is active (a question's prefill, then each decoding
step): everything else the model computes is untouched. The vLLM connector cannot express it:
it changes attention after the prefill, in every decoding step, which vLLM's attention backends
compute with no hook for it.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch

from .generate import Continuation
from .model import KVModel
from .stack import attention_probs

TOP_TOKENS = 5  # a chunk's score: the mass of its this many most attended tokens (the paper's top-5)
_NAME = "sparsecache-selective"
_ACTIVE: ContextVar[tuple[list[tuple[int, int]], int] | None] = ContextVar("sparsecache_selective", default=None)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **_):
    """transformers' attention-function signature: (output (B, T, nh, D), None). The queries are
    the last T positions of the cache (a prefill or decoding step after the context)."""
    spans, n = _ACTIVE.get()
    N, T = key.shape[-2], query.shape[-2]
    q_pos = torch.arange(N - T, N, device=query.device)
    cap = softcap if softcap is not None else getattr(module, "attn_logit_softcapping", None)
    probs = attention_probs(query, key, q_pos, scaling if scaling is not None else module.scaling,
                            getattr(module, "sliding_window", None), cap)  # (1, nh, T, N)
    probs = keep_chunks(probs, spans, n)
    out = probs.to(value.dtype) @ value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    return out.transpose(1, 2).contiguous(), None


def keep_chunks(probs: torch.Tensor, spans: list[tuple[int, int]], n: int) -> torch.Tensor:
    """probs (..., N) with every chunk but the `n` of most top-`TOP_TOKENS` mass zeroed (per
    row), renormalised. Positions outside `spans` always keep their mass."""
    if n >= len(spans):
        return probs
    mass = torch.stack([probs[..., a:b].topk(min(TOP_TOKENS, b - a), dim=-1).values.sum(-1) for a, b in spans], -1)
    dropped = torch.ones_like(mass, dtype=torch.bool).scatter(-1, mass.topk(n, dim=-1).indices, False)
    out = probs.clone()
    for c, (a, b) in enumerate(spans):
        out[..., a:b] = out[..., a:b].masked_fill(dropped[..., c:c + 1], 0.0)
    return out / out.sum(-1, keepdim=True)


@contextlib.contextmanager
def selective(model: KVModel, spans: list[tuple[int, int]], n: int):
    """While the block runs, `model`'s attention keeps each head's `n` best chunks of `spans`
    ([start, end) positions in the cache) for every query."""
    from transformers import AttentionInterface

    AttentionInterface.register(_NAME, _attention)
    config = model.config
    saved = config._attn_implementation_internal
    token = _ACTIVE.set((list(spans), n))
    config._attn_implementation_internal = _NAME
    try:
        yield
    finally:
        config._attn_implementation_internal = saved
        _ACTIVE.reset(token)


class SelectiveContinuation(Continuation):
    """Decoding after the question with each step's attention selective over `spans`."""

    def __init__(self, cache, position: int, model: KVModel, spans: list[tuple[int, int]], n: int):
        super().__init__(cache, position, model)
        self.spans, self.n = spans, n

    def __call__(self, token: int, offset: int) -> torch.Tensor:
        with selective(self.model, self.spans, self.n):
            return super().__call__(token, offset)
