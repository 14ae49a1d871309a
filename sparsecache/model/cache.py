"""A model cache laid out from stored K/V, and tokens of it recomputed in place.

The context is [shared prefix, chunk 1, chunk 2, …] at global positions 0..S-1: pre-RoPE keys
are rotated where they land (`assemble`). `recompute` runs chosen tokens through every layer at
their global positions, attending causally to the cache, and overwrites their K/V layer by
layer (A³ Eqs. 4-5); with every token chosen that is exactly a full prefill, which is what the
model gate (`check.py`) checks. Which tokens a query recomputes is its method's choice
(`sparsecache.query.blend` scores and selects them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .kvmodel import KVModel, kv_cache
from .stack import Batch, Pass, Stack, as_stack


@dataclass
class Context:
    """Prefix + chunks in a model cache at positions 0..S-1 (post-RoPE keys, batch 1)."""

    cache: DynamicCache
    token_ids: torch.Tensor  # int64 [S] on the model's device
    prefix_len: int
    spans: list[tuple[int, int]]  # [start, end) positions of each chunk
    timings_ms: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.token_ids.shape[0])



def assemble(prefix_ids: list[int], prefix_kv: tuple[torch.Tensor, torch.Tensor], chunk_ids: list[list[int]],
             chunk_kv: list[tuple[torch.Tensor, torch.Tensor]], model: "KVModel | Stack") -> Context:
    """A Context from pre-RoPE K/V [n_layers, T, m] of the prefix and each chunk, in that order
    (on the device and in the cache dtype of `model`, a KVModel or an engine's Stack)."""
    dev = model.device
    keys = torch.cat([prefix_kv[0].to(dev)] + [k.to(dev) for k, _ in chunk_kv], dim=1)  # (L, S, m)
    values = torch.cat([prefix_kv[1].to(dev)] + [v.to(dev) for _, v in chunk_kv], dim=1)
    S = keys.shape[1]
    keys = model.rope.rotate_(keys.float(), torch.arange(S, device=dev))
    return Context(kv_cache(keys, values, model), *layout(prefix_ids, chunk_ids, dev))



def layout(prefix_ids: list[int], chunk_ids: list[list[int]], device) -> tuple[torch.Tensor, int, list]:
    """Token ids [S] of prefix + chunks on `device`, the prefix length, and each chunk's
    [start, end) positions: the Context fields every way of filling a cache shares."""
    spans, start = [], len(prefix_ids)
    for ids in chunk_ids:
        spans.append((start, start + len(ids)))
        start += len(ids)
    tokens = torch.tensor(list(prefix_ids) + [t for ids in chunk_ids for t in ids], dtype=torch.long, device=device)
    return tokens, len(prefix_ids), spans



def as_ids(ids: list[int] | torch.Tensor, stack: Stack) -> torch.Tensor:
    return torch.as_tensor(ids, dtype=torch.long).to(stack.device)



def truncate(cache: DynamicCache, length: int) -> None:
    """Drop every position from `length` on, in every layer (what a pass appended)."""
    for layer in cache.layers:
        if layer.keys is not None and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[:, :, :length]
            layer.values = layer.values[:, :, :length]



@torch.inference_mode()
def recompute(ctx: Context, positions: torch.Tensor, model: "KVModel | Stack", blocks: int = 1,
              q_ids: list[int] | None = None) -> torch.Tensor | None:
    """Recompute K/V of the tokens at `positions` (sorted) in every layer, in place.

    All positions of a layer go through at once, a few large operations. `blocks` > 1
    splits them by position, each pass attending only to keys up to its last position:
    the same result, with up to half the attention work skipped instead of masked, but as
    many more small operations; on a CPU one pass measured as fast or faster up to 8K
    tokens of context (BENCHMARKS.md, "The query path on a busy CPU").

    With `q_ids`, the question rides along after the context (positions S.., its K/V join
    the cache as `prefill` would add them) and the float32 next-token logits are returned:
    a question token at layer l attends to layer l's recomputed K/V exactly as it would
    after a separate recomputation, and the question costs no pass of its own (on a busy CPU
    every pass is thousands of small operations, each paying for the scheduler).
    """
    stack = as_stack(model)
    pos, ids = positions.to(stack.device), ctx.token_ids.to(stack.device)
    if q_ids:
        S = ctx.length
        pos = torch.cat([pos, torch.arange(S, S + len(q_ids), device=stack.device)])
        ids = torch.cat([ids, as_ids(q_ids, stack)])
        if stack.graphs is not None and stack.graphs.active(ctx.cache):  # one padded pass on the query's workspace
            return stack.graphs.logits(ids[pos], pos)
    logits = None
    for part in pos.tensor_split(min(blocks, max(1, pos.numel()))):
        if part.numel():
            logits = stack.run(ids[part], part, Pass(ctx.cache, part), logits=bool(q_ids))
    return logits if q_ids else None



@torch.inference_mode()
def recompute_many(ctxs: list[Context], positions: list[torch.Tensor], model: "KVModel | Stack") -> None:
    """`recompute` (in one pass, no question) of several contexts at once: all their selected
    tokens in one run through the layers, each attending over its own cache (`stack.Batch`).
    What a serving engine does with the requests one step admits."""
    stack = as_stack(model)
    runs = [(c, p.to(stack.device)) for c, p in zip(ctxs, positions) if p.numel()]
    if runs:
        ids = torch.cat([c.token_ids.to(stack.device)[p] for c, p in runs])
        stack.run(ids, torch.cat([p for _, p in runs]), Batch([Pass(c.cache, p) for c, p in runs]))

