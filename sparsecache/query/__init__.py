"""The query runtime: a question and a store become the model's cache and an answer.

- `config`: `QueryConfig`, what a query does with its retrieved chunks (light: no torch);
- `methods/`: the registry of query methods, one module per method;
- `context`: `QueryContext`, what a method is handed (model, device, store, rates, selector, raw KV);
- `session`: `Session`, a store, model and embedder loaded once, answering questions;
- `raw`: the raw-KV baseline's files (exact fp16 per-chunk K/V), shared with the vLLM connector;
- `blend`: decoded chunks laid out at their positions, scored, selected and recomputed;
- `stack`: the model's layers run with attention routed through our own caches;
- `overlap`: cake's two-thread prefill/decode overlap and the rates that split it;
- `generate`: prefill and greedy decoding on a cache.

`Session` and `Answer` are re-exported here lazily (they import torch).
"""

from .config import QueryConfig

__all__ = ["Answer", "QueryConfig", "Session"]


def __getattr__(name: str):
    if name in ("Session", "Answer"):
        from . import session

        return getattr(session, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
