"""Load/recompute overlap (Cake's two pointers, from "RAG Workloads Performance with KV Cache
Partial Recomputation"): while one thread reads and decodes chunks from the end of the
context, another recomputes chunks from its start by prefill of their tokens; they meet
where neither is waiting. The start of the context is then exact (it was computed with
everything before it, like full prefill); the rest is decoded codes at global positions.

The paper's warning holds: recomputation pays only where loading is slow. On a fast local
store decoding a chunk costs a fraction of prefilling it, so the loader takes almost every
chunk; on cold storage or an object store the computing thread takes more.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..model.cache import Context, assemble, layout
from ..model.kvmodel import KVModel, cache_heads, model_inputs
from .blend import restore_first_layer, with_header


def cake_split(context_tokens: int, decode_tokens_per_s: float, prefill_tokens_per_s: float) -> int:
    """Leading context tokens to recompute while the rest loads, in this loop's orientation:
    compute N tokens while S − N load, both done together when N / r_p = (S − N) / r_d,
    so N* = S·r_p / (r_p + r_d)."""
    rp, rd = prefill_tokens_per_s, decode_tokens_per_s
    return max(0, min(context_tokens, int(round(context_tokens * rp / (rp + rd)))))


@dataclass
class Rates:
    """Decode and prefill speeds (tokens/s) measured by a session's own queries, smoothed:
    what the closed-form split needs. None until a query has measured it."""

    decode_tokens_per_s: float | None = None
    prefill_tokens_per_s: float | None = None

    def observe(self, kind: str, tokens: int, ms: float) -> None:
        if tokens <= 0 or ms <= 0:
            return
        rate, old = tokens / (ms / 1e3), getattr(self, kind)
        setattr(self, kind, rate if old is None else (old + rate) / 2)

    def split(self, lengths: list[int]) -> int | None:
        """Chunks to recompute by the closed form: the most leading chunks whose tokens fit in
        N* (a chunk past it makes the slower prefill the one everyone waits for), or None
        while either rate is unknown."""
        if self.decode_tokens_per_s is None or self.prefill_tokens_per_s is None:
            return None
        n = cake_split(sum(lengths), self.decode_tokens_per_s, self.prefill_tokens_per_s)
        return max(k for k in range(len(lengths) + 1) if sum(lengths[:k]) <= n)


class _Pointers:
    """Two claims on chunk indices 0..n-1: `front` from the start, `back` from the end."""

    def __init__(self, n: int, split: int | None):
        self.lock = threading.Lock()
        self.front, self.back = 0, n
        self.split = split  # a fixed number of computed chunks, or None: whoever comes first

    def claim_front(self) -> int | None:
        with self.lock:
            if self.front >= self.back or (self.split is not None and self.front >= self.split):
                return None
            self.front += 1
            return self.front - 1

    def claim_back(self) -> list[int]:
        """The next chunks for the loader, in context order: with a fixed split all of its
        side at once (one read and one batched decode, which a GPU needs: decoding 32 chunks
        one by one costs ~1.5× the batch in kernel launches), else one at a time."""
        with self.lock:
            stop = self.front if self.split is None else max(self.front, self.split)
            if self.back <= stop:
                return []
            start = stop if self.split is not None else self.back - 1
            claimed, self.back = list(range(start, self.back)), start
            return claimed


@torch.inference_mode()
def cake_context(store, chunk_ids: list[str], model: KVModel, split: int | None = None, first_layer: bool = True,
                 ) -> tuple[Context, int, int]:
    """The context of `chunk_ids` with its first chunks recomputed and the rest decoded, both
    at once; (context, chunks recomputed, code bytes read). `split` fixes how many chunks are
    recomputed (None: the two threads meet where they meet); with `first_layer`, the decoded
    chunks' layer 0 comes from their tokens (`blend.restore_first_layer`, on this thread once the
    loader is done: the model runs one pass at a time)."""
    prefix_ids, pk, pv = store.prefix()
    tokens = store.layout().chunks(store.tokens(chunk_ids))  # a wrapped store's header before each chunk
    n, dev = len(chunk_ids), model.device
    pointers = _Pointers(n, split)
    decoded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    errors: list[BaseException] = []
    nbytes = [0]

    # On a GPU the decode runs on a stream of its own, or it would queue behind the prefill's
    # kernels on the default stream and nothing would overlap.
    side = torch.cuda.Stream(dev) if dev.type == "cuda" else None

    def load() -> None:
        try:
            with torch.cuda.stream(side) if side is not None else nullcontext():
                while claimed := pointers.claim_back():
                    codes = store.read_codes([chunk_ids[i] for i in claimed])
                    decoded.update(zip(claimed, with_header(store, [[]] * len(claimed),
                                                            store.decode_codes(codes, dev))[1]))
                    nbytes[0] += codes.nbytes
            if side is not None:  # finished before the main stream reads (or frees) them
                side.synchronize()
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    loader = threading.Thread(target=load, name="sparsecache-cake-loader")
    loader.start()
    # the exact prefix, which computed chunks append to (split 0 computes none: not needed)
    cache = assemble(prefix_ids, (pk, pv), [], [], model).cache if split != 0 else None
    position = len(prefix_ids)
    try:
        while (i := pointers.claim_front()) is not None:
            ids = torch.tensor([tokens[i]], device=dev)
            pos = torch.arange(position, position + ids.shape[1], device=dev)[None]
            model.hf.model(**model_inputs(model, ids), position_ids=pos, **{model.cache_arg: cache}, use_cache=True)
            position += ids.shape[1]
    finally:
        loader.join()
    if errors:
        raise errors[0]
    computed = pointers.front
    if first_layer and computed < n:
        restore_first_layer([decoded[i] for i in range(computed, n)],
                            torch.tensor([t for i in range(computed, n) for t in tokens[i]]), model)
    if computed == 0:  # nothing prefilled: exactly `none`'s context, built the same single way
        return assemble(prefix_ids, (pk, pv), tokens, [decoded[i] for i in range(n)], model), 0, nbytes[0]
    if computed < n:  # decoded chunks follow, rotated to where they land
        back_k = torch.cat([decoded[i][0] for i in range(computed, n)], 1).to(dev).float()
        back_v = torch.cat([decoded[i][1] for i in range(computed, n)], 1).to(dev).float()
        back_k = model.rope.rotate_(back_k, torch.arange(position, position + back_k.shape[1], device=dev))
        for layer, k, v in zip(cache.layers, back_k, back_v):  # one copy into the cache's layout, not two
            layer.keys = torch.cat([layer.keys, cache_heads(k, model)], dim=-2)
            layer.values = torch.cat([layer.values, cache_heads(v, model)], dim=-2)
    return Context(cache, *layout(prefix_ids, tokens, dev)), computed, nbytes[0]
