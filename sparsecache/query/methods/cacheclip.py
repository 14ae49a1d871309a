"""`cacheclip`: a small model's full-context pass picks the tokens (CacheClip's auxiliary
selector): `--selector-model`, or the main model truncated to `--selector-layers`.
`Selectors` keeps the auxiliary models a session has loaded."""

from ...errors import ConfigError
from . import register
from .base import Scorer


class CacheClip(Scorer):
    name = "cacheclip"
    summary = ("recompute what a small model's full-context pass attends to (--selector-model, or the first "
               "--selector-layers layers; CacheClip)")
    options = ("selector_model", "selector_layers")
    in_ttft_bench = False  # a full-context pass: slower than full prefill's quarter, measured apart

    def scores(self, ctx, q_ids, cfg, stack, selector=None):
        from ...model.stack import as_stack
        from ..blend import selector_scores

        sel = as_stack(selector) if selector is not None else None
        n = cfg.selector_layers or (sel.n_layers if sel else max(1, stack.n_layers // 4))
        return selector_scores(ctx, q_ids, sel or stack, n)


class Selectors:
    """CacheClip's auxiliary models for one main model and store, each loaded once; calling it
    with a path gives that model (None for None: the main model's own first layers select)."""

    def __init__(self, model, wrapped: bool):
        self.model, self.wrapped = model, wrapped
        self._loaded: dict = {}

    def __call__(self, path: str | None):
        if path is None:
            return None
        if path not in self._loaded:
            from ...model.kvmodel import load_model

            if self.wrapped:
                raise ConfigError("--selector-model cannot read this store's wrapper (its soft tokens are the main "
                                  "model's embeddings): leave it out, and the model's own first layers select")
            selector = load_model(path, device=self.model.device, dtype=self.model.dtype)
            if selector.tokenizer.get_vocab() != self.model.tokenizer.get_vocab():
                raise ConfigError(f"--selector-model {path}: its tokenizer differs from {self.model.name}'s; "
                                  "the selector must read the same token ids")
            self._loaded[path] = selector
        return self._loaded[path]


register(CacheClip())
