"""`EncodeOptions`: how `encode_corpus` runs, the defaults `encode-corpus` offers (light: no torch).

The store-format fields (chunk_tokens … wrapper) are fixed when a store is created: None
means the existing store's own, else the library's default (`StoreConfig`, the model's
shipped dictionary and default wrapper); a value that contradicts an existing store is
refused by the writer."""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import FORWARD_DTYPE, check_forward_dtype
from ..errors import ConfigError
from ..kvstore.index_config import INDEX_KINDS


@dataclass(frozen=True)
class EncodeOptions:
    model: str = "default"  # 'default' (packaged), a local HF directory or a .gguf file
    dictionary: str | None = None  # a learn-dict directory or 'default'; None: the store's own, else the model's
    wrapper: str | None = None  # a learn-wrapper directory, 'shipped' or 'none'; None: the store's own, else the model's default
    # StoreConfig's fields, fixed at creation (None: the store's own, else StoreConfig's default)
    chunk_tokens: int | None = None
    prefix: str | None = None
    anchor: str | None = None
    embedder: str | None = None
    compressor: str | None = None
    coef_dtype: str | None = None
    index_coding: str | None = None
    encode_after: str | None = None  # prefix, document or neighbours (StoreConfig.encode_after, which checks it)
    encode_after_chunks: int | None = None
    # this run
    delete_missing: bool = False  # tombstone documents the corpus no longer has
    index_kind: str = "auto"  # FAISS index kind of the segments this run builds
    adapt_steps: int = 0  # adapt the dictionary to the corpus before a new store's first encode (0: off)
    batch_tokens: int = 8192  # tokens per encode batch (memory vs speed)
    keep: int = 5  # published versions kept (0: all)
    workers: int = 0  # Ray actors on a local Ray cluster (0: this process)
    ray_address: str | None = None  # an existing Ray cluster ('auto' inside `ray job submit`)
    exact_omp: bool = False  # exact Batch-OMP instead of the CPU kernel's screening
    forward_dtype: str = FORWARD_DTYPE  # the forward's precision (dtypes.FORWARD_DTYPES); the K/V are stored float32
    device: str = "auto"  # auto: cuda when present, else cpu
    progress: bool = True  # progress bars and "loading model" on stderr

    def __post_init__(self):
        if self.index_kind not in INDEX_KINDS:
            raise ConfigError(f"index kind must be one of {', '.join(INDEX_KINDS)}, got {self.index_kind!r}")
        for name in ("adapt_steps", "keep", "workers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.batch_tokens < 1:
            raise ConfigError(f"batch-tokens must be >= 1, got {self.batch_tokens}")
        check_forward_dtype(self.forward_dtype)

    def store_fields(self) -> dict:
        """The StoreConfig fields given (None: not given)."""
        return {k: getattr(self, k) for k in ("chunk_tokens", "prefix", "anchor", "embedder", "compressor",
                                              "coef_dtype", "index_coding", "encode_after",
                                              "encode_after_chunks")}
