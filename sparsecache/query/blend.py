"""Query time mechanisms: assemble retrieved chunks into one model cache, score tokens, select,
recompute. Which of them a query uses is its method's choice (`sparsecache.query.methods`).

The context is [shared prefix (exact KV), chunk 1, chunk 2, …] at global positions 0..S-1:
pre-RoPE keys are rotated where they land, so positions are monotonic and there is one
attention sink (CacheClip). Each chunk's KV was computed alone, so cross-chunk attention is
missing; selective recomputation restores it for a fraction r of the chunk tokens, scored by:

- `attention_scores`: the question's attention to each context token at one layer (A³ Eq. 3
  at an early layer, InfoFlow Eq. 7 at an intermediate-to-late one);
- `value_deviation`: the deviation of each token's layer-1 value between full-context and
  cached KV (CacheBlend); `selector_scores`: a small model's full-context attention (CacheClip);
- grouping (CacheClip): recompute whole windows of W tokens, so a multi-token entity is
  never half old, half new: either CacheClip's rule (windows holding at least M of the top
  tokens) or, by default, the windows with the most score mass until the budget is spent
  (the strict rule recomputes almost nothing when the scores are spread out).

Recomputation runs the selected tokens through every layer at their global positions,
attending causally (by position) to the blended cache, and their new K/V overwrite the
cached ones layer by layer (A³ Eqs. 4-5). With r = 1 that is exactly a full prefill.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..model.cache import Context, as_ids, assemble, truncate
from ..model.kvmodel import KVModel
from ..model.stack import Stack, as_stack, attention_probs, first_layer_kv, probe, probe_many
from ..stopwatch import Stopwatch

# ---------------------------------------------------------------- assembly


def load_cache(store, chunk_ids: list[str], model: KVModel, device=None) -> Context:
    """The store's prefix and chunks (decoded on `device`, in the order given) in a DynamicCache.

    `Context.timings_ms` has read (storage → host), transfer (host → device) and reconstruct
    (unpack + gather + weighted sum + RoPE) times, and `bytes_read`.
    """
    dev = torch.device(device) if device is not None else model.device
    watch = Stopwatch(dev)
    chunks = decode_chunks(store, chunk_ids, dev, watch, model)
    with watch.step("reconstruct"):
        ctx = chunks.assemble(model)
    ctx.timings_ms = dict(watch, bytes_read=chunks.nbytes)
    return ctx


@dataclass
class DecodedChunks:
    """The shared prefix and some chunks' decoded pre-RoPE K/V, not yet placed anywhere."""

    prefix_ids: list[int]
    prefix_kv: tuple[torch.Tensor, torch.Tensor]
    ids: list[str]
    tokens: list[list[int]]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    nbytes: int

    def assemble(self, model: "KVModel | Stack") -> Context:
        return assemble(self.prefix_ids, self.prefix_kv, self.tokens, self.kv, model)

    def to(self, device) -> "DecodedChunks":
        """The chunks' K/V as float32 on `device`."""
        kv = [(k.to(device).float(), v.to(device).float()) for k, v in self.kv]
        return dataclasses.replace(self, kv=kv)

    def reordered(self, order: list[int]) -> "DecodedChunks":
        return DecodedChunks(self.prefix_ids, self.prefix_kv, [self.ids[i] for i in order],
                             [self.tokens[i] for i in order], [self.kv[i] for i in order], self.nbytes)


def decode_chunks(store, chunk_ids: list[str], device, watch: Stopwatch,
                  first_layer: "KVModel | Stack | None" = None) -> DecodedChunks:
    """Read and decode `chunk_ids` (and the prefix), timing read, transfer and reconstruct; with
    `first_layer` (a model), layer 0 of the chunks comes from their tokens (`restore_first_layer`)."""
    with watch.step("read"):
        codes = store.read_codes(list(chunk_ids))
        prefix_ids, pk, pv = store.prefix()
    kv = store.decode_codes(codes, device, watch)
    tokens = [t.tolist() for t in torch.from_numpy(codes.tokens).split(codes.lengths)]
    if first_layer is not None:
        with watch.step("reconstruct"):
            restore_first_layer(kv, torch.from_numpy(codes.tokens), first_layer)
    return stored_chunks(store, prefix_ids, (pk, pv), list(chunk_ids), tokens, kv, int(codes.nbytes))


@torch.inference_mode()
def restore_first_layer(kv: list[tuple[torch.Tensor, torch.Tensor]], tokens: torch.Tensor,
                        model: "KVModel | Stack") -> None:
    """Overwrite layer 0 of each chunk's decoded (keys, values) [n_layers, T, m] with the exact
    K/V of its tokens (`tokens`: the chunks' ids concatenated), in place. Layer 0's pre-RoPE K/V
    is a function of the token alone, so the codes' error there is avoidable, and it is the
    layer where some models are most sensitive to it (Qwen2.5: docs/benchmarks-history.md, "Layer 0 from the
    tokens"). One run of the embedding and layer 0's projections over all the chunks' tokens."""
    if not kv:
        return
    k0, v0 = first_layer_kv(model, tokens)
    for (k, v), a, b in zip(kv, k0.split([k.shape[1] for k, _ in kv]), v0.split([v.shape[1] for _, v in kv])):
        k[0] = a.to(k.device, k.dtype)
        v[0] = b.to(v.device, v.dtype)


def stored_chunks(store, prefix_ids: list[int], prefix_kv, ids: list[str], tokens: list[list[int]],
                  kv: list[tuple[torch.Tensor, torch.Tensor]], nbytes: int) -> DecodedChunks:
    """DecodedChunks of what a store read gave; in a wrapped store every chunk (stored with its
    trailer) gets the store's one header in front, K/V and soft token ids, as it was encoded."""
    return DecodedChunks(prefix_ids, prefix_kv, ids, *with_header(store, tokens, kv), nbytes)


def with_header(store, tokens: list[list[int]], kv: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[list[list[int]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Chunks' token ids and pre-RoPE K/V as a query lays them out (`ContextLayout.chunks`): in a
    wrapped store, the store's header (soft token ids, exact K/V) in front of each; as they are otherwise."""
    header = store.header()
    if header is None:
        return tokens, kv
    _, hk, hv = header
    return store.layout().chunks(tokens), [(torch.cat([hk.to(k.device, k.dtype), k], 1),
                                            torch.cat([hv.to(v.device, v.dtype), v], 1)) for k, v in kv]


@torch.inference_mode()
def attention_order(chunks: DecodedChunks, q_ids: list[int], model: KVModel, layer: int, budget: float) -> list[int]:
    """Chunk indices ordered least to most important, so the most important lands next to the
    question (InfoFlow's reordering). A chunk's importance is the question's attention mass at
    `layer` on its top `budget` of tokens, with the chunk placed alone after the prefix: every
    chunk is scored at the same positions, so none is favoured for where retrieval put it."""
    importance = []
    for tokens, kv in zip(chunks.tokens, chunks.kv):
        ctx = assemble(chunks.prefix_ids, chunks.prefix_kv, [tokens], [kv], model)
        scores = attention_scores(ctx, q_ids, model, layer)[ctx.prefix_len:]
        top = max(1, round(budget * len(tokens)))
        importance.append(float(scores.topk(min(top, len(tokens))).values.sum()))
    return sorted(range(len(importance)), key=importance.__getitem__)


# ---------------------------------------------------------------- scoring


@torch.inference_mode()
def attention_scores(ctx: Context, q_ids: list[int], model: "KVModel | Stack", layer: int) -> torch.Tensor:
    """float32 [S]: attention mass the question's tokens give each context position at `layer`,
    summed over question tokens and heads (A³ Eq. 3 at an early layer, InfoFlow Eq. 7 later).
    The question runs through the layers up to `layer` after the context, as its prefill would."""
    return attention_scores_many([ctx], [q_ids], model, layer)[0]


@torch.inference_mode()
def attention_scores_many(ctxs: list[Context], q_ids: list[list[int]], model: "KVModel | Stack",
                          layer: int) -> list[torch.Tensor]:
    """`attention_scores` of several contexts and their questions, the questions run through
    the layers together (`stack.Batch`)."""
    stack = as_stack(model)
    positions = [torch.arange(c.length, c.length + len(q), device=stack.device) for c, q in zip(ctxs, q_ids)]
    graphs = stack.graphs
    if graphs is not None and all(graphs.active(c.cache) for c in ctxs):  # the one mirrored context
        return [graphs.scores(as_ids(q, stack), p, layer) for q, p in zip(q_ids, positions)]
    try:
        seen = probe_many(stack, [(c.cache, as_ids(q, stack), p) for c, q, p in zip(ctxs, q_ids, positions)], layer)
        scores = []
        for c, s, p in zip(ctxs, seen, positions):
            keys = c.cache.layers[layer].keys[:, :, : int(p[-1]) + 1]
            probs = attention_probs(s.q, keys, p, s.scale, s.window, s.softcap)  # (1, nh, Q, S+Q)
            scores.append(probs[0, :, :, : c.length].sum((0, 1)))
        return scores
    finally:
        for c in ctxs:
            truncate(c.cache, c.length)  # the questions' K/V do not stay behind


@torch.inference_mode()
def selector_scores(ctx: Context, q_ids: list[int], selector: "KVModel | Stack", n_layers: int) -> torch.Tensor:
    """float32 [S]: CacheClip's selection signal. A full-context prefill of the context's tokens
    through the selector's first `n_layers` layers, then the question's attention mass on each
    context token at the last of them: exact cross-chunk attention, at a fraction of the cost."""
    stack = as_stack(selector)
    n = min(n_layers, stack.n_layers)
    full = Context(_context_pass(ctx, stack, n), ctx.token_ids, ctx.prefix_len, ctx.spans)
    return attention_scores(full, q_ids, stack, n - 1).to(ctx.token_ids.device)


def _context_pass(ctx: Context, stack: Stack, n_layers: int) -> DynamicCache:
    """A fresh cache holding the context's own K/V through the first `n_layers` layers (a full
    prefill of them; the last layer's K/V only)."""
    cache = stack.empty_cache(ctx.length)
    probe(stack, cache, ctx.token_ids.to(stack.device), torch.arange(ctx.length, device=stack.device), n_layers - 1)
    return cache


@torch.inference_mode()
def value_deviation(ctx: Context, model: "KVModel | Stack", layer: int = 1) -> torch.Tensor:
    """float32 [S]: ‖V_full − V_cached‖ per token at `layer`, V_full from a full-context
    prefill of the layers below it (CacheBlend's selection signal)."""
    stack = as_stack(model)
    cache, pos = stack.empty_cache(ctx.length), torch.arange(ctx.length, device=stack.device)
    v_full = probe(stack, cache, ctx.token_ids.to(stack.device), pos, layer).v[0].transpose(0, 1).flatten(1)  # (S, m)
    v_cached = ctx.cache.layers[layer].values[0, :, : ctx.length].transpose(0, 1).flatten(1)  # (S, m)
    return (v_full.float() - v_cached.float()).norm(dim=-1)


def select(scores: torch.Tensor, ctx: Context, ratio: float, window: int = 1, min_selected: int = 0) -> torch.Tensor:
    """Sorted int64 positions to recompute among the chunk tokens, about `ratio` of them.

    window == 1: the top tokens by `scores` [S]. window > 1, min_selected > 0: CacheClip's
    rule, whole windows holding at least `min_selected` of the top tokens (or all of a shorter
    last window); the rest of the selection is dropped, so fewer tokens may be recomputed.
    window > 1, min_selected == 0: whole windows by their total score until the budget is spent.
    """
    n = ctx.length - ctx.prefix_len
    return _select_k(scores, ctx.prefix_len, min(n, int(round(ratio * n))), window, min_selected)


def select_chunks(scores: torch.Tensor, ctx: Context, ratio: float, window: int = 1,
                  min_selected: int = 0) -> torch.Tensor:
    """Sorted int64 positions to recompute, about `ratio` of the chunk tokens, whole chunks first.

    The chunks are ranked by the mass of `scores` [S] they hold (the question's attention); the
    best are taken whole, in that order, while each fits what is left of the budget (a window's
    worth of tokens over it allowed, so a budget of exactly two chunks takes two). The first that
    does not fit ends the whole chunks, and the rest of the budget goes to `select`'s choice among
    the tokens of the other chunks."""
    P, S = ctx.prefix_len, ctx.length
    k = min(S - P, int(round(ratio * (S - P))))
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=scores.device)
    mass = torch.stack([scores[a:b].float().sum() for a, b in ctx.spans])
    whole = torch.zeros(S, dtype=torch.bool, device=scores.device)
    used = 0
    for i in mass.argsort(descending=True).tolist():
        a, b = ctx.spans[i]
        if used + (b - a) > k + max(window, 1):
            break
        whole[a:b] = True
        used += b - a
    rest = _select_k(scores.masked_fill(whole, 0), P, max(0, k - used), window, min_selected)
    whole[rest] = True
    return torch.nonzero(whole).flatten()


def _select_k(scores: torch.Tensor, P: int, k: int, window: int, min_selected: int) -> torch.Tensor:
    """`select`'s rule for `k` positions among those from `P` on."""
    n = scores.shape[0] - P
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=scores.device)
    if window <= 1:
        return (scores[P:].topk(k).indices + P).sort().values
    rel = torch.arange(n, device=scores.device) // window  # window of each chunk token
    zeros = torch.zeros(int(rel[-1]) + 1, dtype=scores.dtype, device=scores.device)
    if min_selected == 0:
        mass = zeros.index_add(0, rel, scores[P:].float())
        best = mass.topk(min(len(mass), -(-k // window))).indices
        keep = torch.zeros(len(mass), dtype=torch.bool, device=scores.device)
        keep[best] = True
        return (torch.nonzero(keep[rel]).flatten() + P).sort().values
    chosen = torch.zeros(n, dtype=scores.dtype, device=scores.device)
    chosen[scores[P:].topk(k).indices] = 1
    counts = zeros.index_add(0, rel, chosen)
    sizes = zeros.index_add(0, rel, torch.ones_like(chosen))  # the last window may be short
    keep = counts[rel] >= sizes[rel].clamp(max=min_selected)
    return (torch.nonzero(keep).flatten() + P).sort().values


# ---------------------------------------------------------------- recomputation


