"""sparsecache: compressed KV-cache corpus builder and store for RAG."""

__version__ = "0.1.0"
