"""How the tokens after the context (the question and the answer) attend over independently
encoded chunks: selective attention, APE's calibration, or both.

- **Selective attention** (`--attend-chunks N`). Chunks encoded alone each carry their own
  attention sinks and pull the question's attention apart: the more parallel chunks, the higher
  its attention entropy ("Attention Entropy is a Key Factor", ACL 2025). Its remedy: for every
  head and query token, score each chunk by the sum of its `TOP_TOKENS` largest attention
  probabilities, keep the `n` best chunks (the prefix and the tokens after the context always
  stay), zero the rest and renormalise.
- **APE's calibration** (`--ape-temperature T --ape-scale S`, "APE: Faster and Longer
  Context-Augmented Generation via Adaptive Parallel Encoding", ICLR 2025). APE attends to the
  prefix, the chunks and the query tokens as three blocks merged by their log-sum-exps, the
  chunk block's logits divided by T and its log-sum-exp multiplied by T·S (its code: T = 0.9,
  S = 0.9–1.0). That is one softmax over logits whose chunk entries are
  l / T + (T·S − 1) · LSE_chunks(l / T) (`ape_logits`), in the layers from `--ape-from-layer` on.

Both run inside transformers' layers as an attention function (`AttentionInterface`), named in
the model's config only while `attending` is active (a question's prefill, then each decoding
step): everything else the model computes is untouched. The vLLM connector cannot express
either: they change attention after the prefill, in every decoding step, which vLLM's attention
backends compute with no hook for it.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from .generate import Continuation
from .model import KVModel
from .stack import attention_logits

TOP_TOKENS = 5  # a chunk's score: the mass of its this many most attended tokens (the paper's top-5)
_NAME = "sparsecache-attend"


@dataclass(frozen=True)
class ChunkAttention:
    """How the tokens after the context attend over the chunks at `spans` ([start, end) cache
    positions): the `keep` best chunks per head (0: all), APE's `temperature` and `scale` in the
    layers from `from_layer` on (1, 1: off)."""

    spans: tuple[tuple[int, int], ...]
    keep: int = 0
    temperature: float = 1.0
    scale: float = 1.0
    from_layer: int = 0

    @classmethod
    def of(cls, cfg, spans) -> "ChunkAttention | None":
        """What a QueryConfig asks for over `spans`, or None when it asks for plain attention."""
        if not cfg.attends:
            return None
        return cls(tuple(map(tuple, spans)), cfg.attend_chunks, cfg.ape_temperature, cfg.ape_scale, cfg.ape_from_layer)

    def weights(self, logits: torch.Tensor, layer: int) -> torch.Tensor:
        """Attention probabilities from masked logits (..., N) at `layer`."""
        if layer >= self.from_layer and (self.temperature, self.scale) != (1.0, 1.0):
            logits = ape_logits(logits, self.spans, self.temperature, self.scale)
        return keep_chunks(logits.softmax(-1), self.spans, self.keep) if self.keep else logits.softmax(-1)


_ACTIVE: ContextVar[ChunkAttention | None] = ContextVar("sparsecache_attend", default=None)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **_):
    """transformers' attention-function signature: (output (B, T, nh, D), None). The queries are
    the last T positions of the cache (a prefill or decoding step after the context)."""
    how = _ACTIVE.get()
    N, T = key.shape[-2], query.shape[-2]
    q_pos = torch.arange(N - T, N, device=query.device)
    cap = softcap if softcap is not None else getattr(module, "attn_logit_softcapping", None)
    logits = attention_logits(query, key, q_pos, scaling if scaling is not None else module.scaling,
                              getattr(module, "sliding_window", None), cap)  # (1, nh, T, N)
    probs = how.weights(logits, getattr(module, "layer_idx", 0))
    out = probs.to(value.dtype) @ value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    return out.transpose(1, 2).contiguous(), None


def ape_logits(logits: torch.Tensor, spans, temperature: float, scale: float) -> torch.Tensor:
    """logits (..., N) with the chunk positions' entries l / T + (T·S − 1) · LSE_chunks(l / T):
    their softmax gives the chunk block the mass exp(T·S · LSE_chunks(l / T)) against the other
    positions' exp(l), spread within it by softmax(l / T), as APE's blockwise merge does."""
    inside = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    for a, b in spans:
        inside[a:b] = True
    chunk = logits[..., inside] / temperature
    lse = torch.logsumexp(chunk, -1, keepdim=True)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # a row that sees no chunk (a sliding window)
    out = logits.clone()
    out[..., inside] = chunk + (temperature * scale - 1.0) * lse
    return out


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
def attending(model: KVModel, how: ChunkAttention | None):
    """While the block runs, `model`'s attention for every query follows `how` (nothing changes
    with None)."""
    if how is None:
        yield
        return
    from transformers import AttentionInterface

    AttentionInterface.register(_NAME, _attention)
    config = model.config
    saved = config._attn_implementation_internal
    token = _ACTIVE.set(how)
    config._attn_implementation_internal = _NAME
    try:
        yield
    finally:
        config._attn_implementation_internal = saved
        _ACTIVE.reset(token)


class AttendingContinuation(Continuation):
    """Decoding after the question with each step's attention over the chunks as `how` says."""

    def __init__(self, cache, position: int, model: KVModel, how: ChunkAttention):
        super().__init__(cache, position, model)
        self.how = how

    def __call__(self, token: int, offset: int) -> torch.Tensor:
        with attending(self.model, self.how):
            return super().__call__(token, offset)
