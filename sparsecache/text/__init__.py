"""The text a pipeline starts from: the built-in calibration documents (Python's documentation,
split into train and held-out parts) and token chunks of them (`documents`), and a user's
corpus scanned into sources and chunked the way a store holds it (`corpus`)."""

from .documents import BUILTIN, Document, builtin_documents, interleaved_chunks, read_documents, token_chunks

__all__ = ["BUILTIN", "Document", "builtin_documents", "interleaved_chunks", "read_documents", "token_chunks"]
