"""The `vllm.general_plugins` entry point: remembers the model each vLLM process loads.

vLLM gives a KV connector its config and its KV caches, never the model, and blending must
run the engine's own layers on the engine's own weights (no second copy). vLLM loads its
plugins in every process before it loads the model, so this entry point wraps the model
loaders' `load_model` and keeps a weak reference to what they return; the connector's
worker, created after the model is loaded, looks it up with `loaded_model`. (LMCache hands
its blender the model the same way.) Nothing else changes: vLLM without the connector
runs as before. `VLLM_PLUGINS`, where set, must name `sparsecache` for blending to work.
"""

from __future__ import annotations

import functools
import weakref

_LOADED: list[tuple[object, weakref.ref]] = []  # (model_config, model) in load order


def register() -> None:
    """Wrap `BaseModelLoader.load_model` (every loader that does not override it: the default,
    GGUF, safetensors, dummy ones); idempotent, as vLLM may call plugins more than once."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.load_model
    if getattr(original, "_sparsecache", False):
        return

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        model = original(self, *args, **kwargs)
        model_config = kwargs["model_config"] if "model_config" in kwargs else args[1]
        _LOADED.append((model_config, weakref.ref(model)))
        return model

    load_model._sparsecache = True
    BaseModelLoader.load_model = load_model


def loaded_model(model_config):
    """The live model this process loaded for `model_config` (the same object the worker's
    config holds), or the only live one, or None."""
    live = [(c, r()) for c, r in _LOADED if r() is not None]
    same = [m for c, m in live if c is model_config]
    if same:
        return same[-1]
    return live[0][1] if len(live) == 1 else None
