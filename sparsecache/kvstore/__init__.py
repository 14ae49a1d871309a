"""Retrieval and the versioned KV view: the FAISS index and the embedder (`index`), its
settings (`index_config`, light: the CLI reads them), and `KVStore` (`view`), a store version
seen through its dictionary and index: search, decode, read chunk text.

It is a package of its own, not part of `sparsecache.store`, because storage knows bytes,
arrays and manifests and never imports the codec's decoding, the model or FAISS; this is the
layer above it that does. `from sparsecache.kvstore import KVStore` (and `verify`, `compact`)
resolves on first use, so the light `index_config` imports neither FAISS nor torch.
"""


from .. import names_from

__getattr__ = names_from(__name__, "view")
