"""The codec and its dictionaries: how a model's K/V becomes a few atoms and back.

- `coding`: `Codec`, signals ⇄ codes (atom indices as packed or Elias–Fano rows, fp16/fp8/int8
  coefficients), decode by gather-accumulate (`_decode_cpu` on a CPU, `embedding_bag` elsewhere);
- `codes`, `bitpack`: what a stored code is and its index layouts (torch-free: the store imports them);
- `signals`: per-layer K/V ⇄ signals of L concatenated layers;
- `omp`: Batch-OMP (`_omp_cpu` a fused numba loop, `_omp_cuda` one Triton kernel);
- `dictionary`: the `Dictionary` artifact, its format, fingerprint and the shipped ones;
- `learn`: learning and adapting a dictionary; `config`: `DictConfig`, `TrainConfig`, `AdaptConfig`.

The package imports nothing heavy itself: `Codec`, `Dictionary` and the configs are re-exported
here lazily, so the torch-free store can import `codes` and `bitpack` from it.
"""

_LAZY = {"Codec": "coding", "COEF_DTYPES": "coding", "COEF_FORMATS": "coding", "Dictionary": "dictionary",
         "DictConfig": "config", "TrainConfig": "config", "AdaptConfig": "config"}


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
