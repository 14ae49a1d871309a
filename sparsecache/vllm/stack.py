"""The model vLLM loaded, as the `Stack` blending runs on (`sparsecache.model.stack`).

vLLM's decoder models share one shape: `model.model.embed_input_ids(ids)` (a wrapped store's
soft tokens, ids < 0, are the store's embeddings instead: `model.embed_soft`), then each layer
`layer(positions, hidden, residual) -> (hidden, residual)` (norms fused with the residual
add), then `model.model.norm(hidden, residual)` and `model.compute_logits`. Each layer's
attention module (`Attention`) receives post-RoPE q, k, v [T, heads·D] from the family's
own projections, norms and rotary embedding, and normally attends through the paged cache
and the step's metadata. Blending calls the layers directly (eagerly, outside vLLM's
compiled forward), with each `Attention`'s forward routed to a pass over a contiguous cache
while it runs. The engine's forward never runs meanwhile: the connector blends inside
`start_load_kv`, before the step's forward, on the same thread.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..model.kvmodel import Rope, embed_soft
from ..model.stack import Pass, Stack


class UnsupportedModel(Exception):
    """vLLM's model does not have the shape blending drives (the reason is the message)."""


def _attention_modules(layer: torch.nn.Module) -> list[torch.nn.Module]:
    from vllm.model_executor.layers.attention.attention import Attention

    return [m for m in layer.modules() if isinstance(m, Attention)]


class VLLMStack(Stack):
    def __init__(self, model: torch.nn.Module, vllm_config):
        inner = getattr(model, "model", None)
        layers = list(getattr(inner, "layers", []) or [])
        if not layers or not hasattr(model, "compute_logits"):
            raise UnsupportedModel(f"{type(model).__name__} is not a decoder stack (model.model.layers)")
        for need in ("embed_input_ids", "norm"):
            if not hasattr(inner, need):
                raise UnsupportedModel(f"{type(model).__name__} has no model.{need}")
        if (getattr(inner, "start_layer", 0), getattr(inner, "end_layer", len(layers))) != (0, len(layers)):
            raise UnsupportedModel("pipeline parallelism splits the layers over processes")
        attn = [_attention_modules(layer) for layer in layers]
        if any(len(a) != 1 for a in attn):
            raise UnsupportedModel("a layer without exactly one attention module (shared or cross-layer KV)")
        config = vllm_config.model_config.hf_config
        self.rope = Rope.for_config(config)
        self.attn = [a[0] for a in attn]
        if any(a.num_kv_heads != self.rope.n_kv_heads for a in self.attn):
            raise UnsupportedModel("tensor parallelism splits the KV heads over processes")
        self.model, self.inner, self.layers = model, inner, layers
        self.n_layers, self.n_kv_heads, self.head_dim = len(layers), self.rope.n_kv_heads, self.rope.head_dim
        self.device = next(model.parameters()).device
        self.dtype = vllm_config.model_config.dtype
        self.soft: torch.Tensor | None = None  # a wrapped store's soft tokens (ids < 0), set per request

    @torch.inference_mode()
    def run(self, ids, positions, attend, n_layers=None, logits=False):
        n = self.n_layers if n_layers is None else n_layers
        h, residual = embed_soft(self.inner.embed_input_ids, ids, self.soft), None  # (T, d)
        with self._routed(attend, n):
            for layer in self.layers[:n]:
                h, residual = layer(positions, h, residual)
        if not logits:
            return None
        h, _ = self.inner.norm(h[-1:].clone(), residual[-1:].clone())
        return self.model.compute_logits(h)[0].float()

    @contextlib.contextmanager
    def _routed(self, attend: Pass, n: int):
        """Each of the first `n` attention modules calls `attend` instead of the paged cache
        while the pass runs (an instance attribute shadows the class's forward)."""
        try:
            for i, a in enumerate(self.attn[:n]):
                a.forward = functools.partial(_attention, i, a, attend)
            yield
        finally:
            for a in self.attn[:n]:
                a.__dict__.pop("forward", None)


def _attention(i: int, layer, attend: Pass, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               output_shape=None, output_dtype=None) -> torch.Tensor:
    """`Attention.forward`'s signature: q [T, nh·D], k and v [T, H·D] → [T, nh·D]."""
    T = query.shape[0]
    q = query.view(T, layer.num_heads, layer.head_size).transpose(0, 1)[None]  # (1, nh, T, D)
    k = key.view(T, layer.num_kv_heads, layer.head_size).transpose(0, 1)[None]  # (1, H, T, D)
    v = value.view(T, layer.num_kv_heads, layer.head_size_v).transpose(0, 1)[None]
    out = attend(i, q, k, v, layer.impl.scale, layer.sliding_window, getattr(layer.impl, "logits_soft_cap", None))
    return out[0].transpose(0, 1).reshape(T, -1)  # (T, nh·D)
