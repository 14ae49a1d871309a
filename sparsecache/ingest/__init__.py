"""Ingest: a corpus becomes a store's chunks (the package was `sparsecache.build` until 2026-11-29).

- `config`: `EncodeOptions`, how an encode runs and what a new store is built with (light: no torch);
- `encoder`: `encode_corpus(corpus, store, options)`, which resolves the dictionary, wrapper and
  store config and runs the model gate, then `encode_with`: scan → plan → batch → append →
  index → publish, resumable;
- `batch`: `code_batch`, one batch of chunks through the model's forward and Batch-OMP;
- `distributed`: the same encode on Ray actors.

A corpus's documents and their chunking (`sparsecache.text.corpus`) stay below the codec:
dictionaries are learned on the same built-in text the encode reads.

`encode_corpus` is re-exported here lazily (it imports torch).
"""

from .config import EncodeOptions

__all__ = ["EncodeOptions", "encode_corpus"]


def __getattr__(name: str):
    if name == "encode_corpus":
        from .encoder import encode_corpus

        return encode_corpus
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
