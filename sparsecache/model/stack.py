"""The model as selective recomputation sees it: a stack of decoder layers whose attention it owns.

Blending (`blend.py`) runs some tokens through the model's layers against a context cache:
the question through the first layers to score the context, the selected tokens through
every layer to recompute them, or the whole context through a few layers (CacheBlend's and
CacheClip's signals). Every engine does the same thing around the attention (embeddings,
norms, projections, the family's rotary module, MLPs), and only the attention must differ
from the engine's own: it reads a contiguous cache in which the tokens being run sit at
their global positions, among tokens that are not being run.

So an engine gives blending a `Stack`: its own layers, run one by one, with each layer's
inner attention routed to a `Pass` (below). Two engines provide one:
- `HFStack` here, over a transformers model (`sparsecache query`);
- `sparsecache.vllm.stack.VLLMStack`, over the model vLLM loaded (the connector).
Scoring, selection and recomputation are then one implementation for both.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..errors import ModelError
from .kvmodel import KVModel, Rope, embed_ids, layer_windows


@dataclass
class Probe:
    """What a pass saw at one layer: the tokens' post-RoPE queries and their values, and the
    layer's attention parameters."""

    q: torch.Tensor  # (1, nh, T, D)
    v: torch.Tensor  # (1, H, T, D)
    scale: float
    window: int | None
    softcap: float | None


class Probed(Exception):
    """Raised by a pass at its probe layer: nothing after that layer's K/V is needed."""


class Pass:
    """One pass of tokens at `positions` (int64 [T], increasing) through a model's layers.

    Each layer's attention writes the tokens' K/V into `cache` at their positions (growing
    a layer that is too short) and attends over the cache up to the last of them, a query at
    position p seeing positions <= p (and > p - W in a layer with window W): the tokens
    between them are whatever the cache holds. With `probe`, the pass stops at that layer's
    attention (raising `Probed`, which `probe` below catches) once it has written the
    layer's K/V and kept its queries and values (what blending's scorers read)."""

    def __init__(self, cache: DynamicCache, positions: torch.Tensor, probe: int | None = None):
        self.cache = cache
        self.positions = positions
        self.limit = int(positions[-1]) + 1
        self.probe = probe
        self.probed: Probe | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """q (1, nh, T, D), k and v (1, H, T, D), post-RoPE → attention output (1, nh, T, D)."""
        c = self.cache.layers[layer]
        if c.keys.shape[-2] < self.limit:
            c.keys, c.values = (_grown(x, self.limit) for x in (c.keys, c.values))
        c.keys[:, :, self.positions] = k.to(c.keys.dtype)
        c.values[:, :, self.positions] = v.to(c.values.dtype)
        keys, values = c.keys[:, :, : self.limit], c.values[:, :, : self.limit]
        if layer == self.probe:
            self.probed = Probe(q, v, scale, window, softcap)
            raise Probed
        return attention(q.to(keys.dtype), keys, values, self.positions, scale, window, softcap).to(q.dtype)


class Batch:
    """Several passes run as one: their tokens follow each other in one run through the layers
    (embeddings, norms, projections and MLPs see them all at once, a few large operations instead
    of many small ones per pass), and each layer's attention gives every pass its own tokens over
    its own cache. All passes probe the same layer, or none does."""

    def __init__(self, passes: list[Pass]):
        self.passes = passes
        self.sizes = [int(p.positions.numel()) for p in passes]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        outs, probed = [], False
        for p, qp, kp, vp in zip(self.passes, *(x.split(self.sizes, dim=2) for x in (q, k, v))):
            try:
                outs.append(p(layer, qp, kp, vp, scale, window, softcap))
            except Probed:
                probed = True  # every pass keeps what it saw before the run stops
        if probed:
            raise Probed
        return torch.cat(outs, dim=2)


def _grown(x: torch.Tensor, length: int) -> torch.Tensor:
    """x (1, H, N, D) with zero positions appended up to `length`."""
    return torch.cat([x, x.new_zeros(*x.shape[:-2], length - x.shape[-2], x.shape[-1])], dim=-2)


def causal_mask(q_pos: torch.Tensor, kv_len: int, window: int | None = None) -> torch.Tensor:
    """bool [1, 1, Q, kv_len]: a query at position p sees keys at positions j <= p (and
    j > p - window in a sliding-window layer), wherever they sit in the cache."""
    kv = torch.arange(kv_len, device=q_pos.device)[None, :]
    seen = kv <= q_pos[:, None]
    if window is not None:
        seen &= kv > q_pos[:, None] - window
    return seen[None, None]


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor, scale: float,
              window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention of queries q (1, nh, Q, D) at positions `q_pos` over a cache's keys and
    values (1, H, N, D) at positions 0..N-1 (GQA: nh a multiple of H) → (1, nh, Q, D)."""
    mask = causal_mask(q_pos, keys.shape[-2], window)
    if not softcap:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    probs = attention_probs(q, keys, q_pos, scale, window, softcap)
    return probs.to(values.dtype) @ values.repeat_interleave(q.shape[1] // values.shape[1], dim=1)


def attention_probs(q: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor, scale: float,
                    window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """float32 (1, nh, Q, N): the attention weights `attention` applies (Gemma 2's soft cap
    on the logits included)."""
    keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)  # GQA: (1, nh, N, D)
    logits = (q.float() @ keys.float().transpose(-1, -2)) * scale  # (1, nh, Q, N)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits.masked_fill(~causal_mask(q_pos, keys.shape[-2], window), float("-inf")).softmax(-1)


class Stack:
    """What blending needs from an engine's model (see the module docstring)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    rope: Rope
    device: torch.device
    dtype: torch.dtype  # of the model's cache
    graphs = None  # `graphs.Graphs` when the fixed passes run as CUDA graphs (`graphs.enable`)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, attend: Pass, n_layers: int | None = None,
            logits: bool | str = False) -> torch.Tensor | None:
        """Run tokens `ids` [T] at `positions` [T] through the first `n_layers` layers (all by
        default), attention routed to `attend`; with `logits`, the float32 next-token logits
        [vocab] after the last token (`logits="all"`: [T, vocab], after every token)."""
        raise NotImplementedError

    def empty_cache(self, length: int) -> DynamicCache:
        """A cache of `length` zero positions in every layer, for a pass that fills it."""
        shape = (1, self.n_kv_heads, length, self.head_dim)
        zeros = lambda: torch.zeros(shape, dtype=self.dtype, device=self.device)  # noqa: E731
        return DynamicCache(ddp_cache_data=[(zeros(), zeros()) for _ in range(self.n_layers)])


def probe(stack: Stack, cache: DynamicCache, ids: torch.Tensor, positions: torch.Tensor, layer: int) -> Probe:
    """Run tokens `ids` at `positions` through layers 0..`layer` (their K/V joining `cache`,
    `layer`'s included) and return what `layer`'s attention received."""
    return probe_many(stack, [(cache, ids, positions)], layer)[0]


def probe_many(stack: Stack, runs: list[tuple[DynamicCache, torch.Tensor, torch.Tensor]], layer: int) -> list[Probe]:
    """`probe` of several (cache, ids, positions) in one run through the layers (a `Batch`)."""
    passes = [Pass(cache, positions, probe=layer) for cache, _, positions in runs]
    try:
        stack.run(torch.cat([ids for _, ids, _ in runs]), torch.cat([p for _, _, p in runs]), Batch(passes),
                  n_layers=layer + 1)
    except Probed:
        return [p.probed for p in passes]
    raise RuntimeError(f"the pass never reached layer {layer}'s attention")


class _FirstLayer:
    """A pass that keeps layer 0's keys and values and stops the run there."""

    k: torch.Tensor
    v: torch.Tensor

    def __call__(self, layer, q, k, v, scale, window=None, softcap=None):
        self.k, self.v = k, v
        raise Probed


@torch.inference_mode()
def first_layer_kv(model: "KVModel | Stack", ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's pre-RoPE keys and values, each float32 [T, m], of tokens `ids` [T] (soft ids < 0
    included): a function of each token alone, since no attention comes before them, computed by
    the engine's own embedding, norm and projections (and k_norm). Every token runs at position 0,
    where RoPE is the identity, and the run stops at layer 0's attention."""
    stack = as_stack(model)
    ids = ids.to(stack.device, torch.long)
    rec = _FirstLayer()
    try:
        stack.run(ids, torch.zeros_like(ids), rec, n_layers=1)
    except Probed:
        return tuple(x[0].transpose(0, 1).flatten(-2).float() for x in (rec.k, rec.v))  # (1, H, T, D) -> [T, H·D]
    raise RuntimeError("the run never reached layer 0's attention")


def as_stack(model: "KVModel | Stack") -> Stack:
    """A Stack as is; a KVModel as its `HFStack`, built once per model (it registers an
    attention function and reads the model's rotary tables)."""
    if isinstance(model, Stack):
        return model
    stack = model.__dict__.get("_stack")
    if stack is None:
        stack = model.__dict__["_stack"] = HFStack(model)
    return stack


# ---------------------------------------------------------------- transformers


_ROUTED = "sparsecache"  # the attention implementation a pass routes transformers' layers to


def _routed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                      sparsecache=None, **_):
    """transformers' attention-function signature: (output (B, T, nh, D), weights)."""
    stack, attend = sparsecache
    i = module.layer_idx
    cap = softcap if softcap is not None else getattr(module, "attn_logit_softcapping", None)
    out = attend(i, query, key, value, scaling if scaling is not None else module.scaling, stack.windows[i], cap)
    return out.transpose(1, 2).contiguous(), None


class HFStack(Stack):
    """A transformers causal LM's layers, each attention module calling a pass through
    transformers' attention-function registry (its own projections, norms and rotary)."""

    def __init__(self, model: KVModel):
        from transformers import AttentionInterface

        AttentionInterface.register(_ROUTED, _routed_attention)
        self.model = model
        self.n_layers, self.n_kv_heads, self.head_dim = model.n_layers, model.n_kv_heads, model.head_dim
        self.rope, self.device, self.dtype = model.rope, model.device, model.hf.dtype
        self.windows = layer_windows(model.config)

    @torch.inference_mode()
    def run(self, ids, positions, attend, n_layers=None, logits=False):
        return self.forward(ids, positions, attend, n_layers, logits)

    def forward(self, ids, positions, attend, n_layers=None, logits=False):
        """`run`, differentiable (in the soft tokens and whatever K/V `attend`'s cache holds): what
        learning a linked trailer runs (`wrapper.learn`)."""
        hf = self.model.hf.model
        n = self.n_layers if n_layers is None else n_layers
        h = embed_ids(self.model, ids[None])  # (1, T, d); a wrapped store's soft tokens have ids < 0
        pe = self.model.rope.embeddings(h, positions[None], n)
        with self._routed():
            for i, block in enumerate(hf.layers[:n]):
                h = block(h, attention_mask=None, position_ids=positions[None], position_embeddings=pe[i],
                          sparsecache=(self, attend))
        if not logits:
            return None
        out = self.model.hf.lm_head(hf.norm(h if logits == "all" else h[:, -1:]))[0].float()
        out = out if logits == "all" else out[-1]
        cap = getattr(self.model.config, "final_logit_softcapping", None)  # Gemma 2/3
        return torch.tanh(out / cap) * cap if cap else out

    @contextlib.contextmanager
    def _routed(self):
        """The model's attention modules look up their function by the config's name on every
        call: name ours while the pass runs (the model serves nothing else meanwhile)."""
        hf = self.model.hf
        saved = hf.config._attn_implementation  # what transformers documents as the model's current one
        hf.set_attn_implementation(_ROUTED)  # ~0.4 ms each way on a 30-layer model: the pass takes far longer
        if hf.config._attn_implementation != _ROUTED:  # a model transformers cannot reroute (it only warns)
            raise ModelError(f"{self.model.name}: transformers cannot route this model's attention, so its chunks "
                             "cannot be recomputed (a family without AttentionInterface support)")
        try:
            yield
        finally:
            hf.set_attn_implementation(saved)
