"""One batch of chunks to codes: the model's forward (pre-RoPE K/V after the shared prefix),
then Batch-OMP. The local encode loop (`encoder`) and the Ray actors (`distributed`) both
code through here, so the two paths cannot drift apart."""

from __future__ import annotations

import torch

from ..codec.coding import Codec
from ..model.kvmodel import KVModel, extract_kv


def code_batch(model: KVModel, codec: Codec, token_lists: list[list[int]], prefix: list[int] | list[list[int]],
               batch_tokens: int, step, on_tokens=None, forward_dtype: str = "float32"):
    """One batch of chunks through the model and Batch-OMP: (K codes, V codes) of their tokens
    in order, timed as "forward" and "omp" by `step(name)`; `on_tokens(n)` is told as OMP's
    blocks finish how many tokens' worth of signals are coded (a CPU batch codes for minutes).
    `prefix`: the token ids every chunk is encoded after, or one list per chunk (a store whose chunks are
    encoded after other chunks: the prefix and what each reads). `forward_dtype`: `extract_kv`'s. The
    local loop and the Ray actors both encode through here."""
    with step("forward"):
        per_chunk = bool(prefix) and isinstance(prefix[0], (list, tuple))
        kv = extract_kv(model, token_lists, [] if per_chunk else prefix, batch_tokens, forward_dtype,
                        prefix if per_chunk else None)
        keys = torch.cat([k for k, _ in kv], dim=1)  # (n_layers, T, m)
        values = torch.cat([v for _, v in kv], dim=1)
        del kv
    signals = 2 * keys.shape[1] * keys.shape[0] // codec.config.layers_per_signal  # K and V
    advance = None if on_tokens is None else (lambda n: on_tokens(n * keys.shape[1] / signals))
    with step("omp"):
        return codec.encode(keys, "k", advance), codec.encode(values, "v", advance)
